"""The files of a manager's run directory: checkpoint names, the index, and a scan of what is there.

A checkpoint of step s is ``ckpt-<s, 9 digits>.ortcp`` (one process) or the set of a distributed save
to that path (``ckpt-<s>.ortcp.manifest.json`` + rank files). Its commit point is that file or that
manifest: the manager never decides completeness from anything else. The index
(``ort_trainer_checkpoints.json``, written atomically by rank 0) records what the manager wrote — each
step's name and metrics — before the save starts, so a save killed half-way is still known as the
manager's own, and pruning deletes only what the index lists. Readers (another process watching the
run) read the index and scan the folder; neither ever needs a lock.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..format import schema as S
from ..io import Location

__all__ = ["INDEX_NAME", "MAX_STEP", "IndexEntry", "checkpoint_name", "read_index", "scan", "write_index"]

INDEX_NAME = "ort_trainer_checkpoints.json"
INDEX_FORMAT = "ort_trainer.checkpoint.index"
INDEX_VERSION = 1
MAX_STEP = 10**18 - 1  # names hold up to 18 digits (the scan below matches no more)
_PREFIX, _SUFFIX = "ckpt-", ".ortcp"
_NAME = re.compile(rf"{_PREFIX}(\d{{1,18}}){re.escape(_SUFFIX)}")
_MANIFEST = re.compile(rf"{_PREFIX}(\d{{1,18}}){re.escape(_SUFFIX + S.MANIFEST_SUFFIX)}")


def checkpoint_name(step: int) -> str:
    """The file name a manager saves step ``step`` to (a distributed save adds rank files and a manifest)."""
    return f"{_PREFIX}{step:09d}{_SUFFIX}"


@dataclass
class IndexEntry:
    """One save the manager started: its step, the name it was saved to, metrics, and the wall time."""

    step: int
    name: str  # checkpoint_name(step)
    metrics: dict[str, float] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "metrics": self.metrics, "time": self.time}


def _entry(item: Any, where: str) -> IndexEntry:
    try:
        return _checked_entry(item, where)
    except (OverflowError, ValueError, TypeError, RecursionError) as exc:  # e.g. a time of 10**400
        shown = repr(item)[:200] if not isinstance(exc, RecursionError) else type(item).__name__
        raise CheckpointFormatError(f"{where}: invalid index entry {shown} ({type(exc).__name__}: {exc})") from None


def _checked_entry(item: Any, where: str) -> IndexEntry:
    ok = isinstance(item, dict) and set(item) == {"step", "name", "metrics", "time"}
    ok = ok and isinstance(item["step"], int) and not isinstance(item["step"], bool) and item["step"] >= 0
    ok = ok and item.get("name") == checkpoint_name(item["step"]) and isinstance(item["metrics"], dict)
    ok = ok and all(isinstance(k, str) and isinstance(v, int | float) for k, v in item["metrics"].items())
    ok = ok and isinstance(item["time"], int | float) and math.isfinite(item["time"])
    if not ok:
        raise CheckpointFormatError(f"{where}: invalid index entry {repr(item)[:200]}")
    return IndexEntry(item["step"], item["name"], {k: float(v) for k, v in item["metrics"].items()}, item["time"])


def read_index(location: Location) -> dict[int, IndexEntry]:
    """The index at ``location`` ({} if there is none); CheckpointFormatError if the file is not ours."""
    try:
        data = location.read_bytes()
    except CheckpointNotFoundError:
        return {}
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # invalid JSON or UTF-8, too deep, an int of > 4300 digits
        raise CheckpointFormatError(
            f"{location.display} is not an ort_trainer checkpoint index (invalid JSON: {exc}); the manager does "
            "not write over files it did not create: move it away or choose another directory"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or not isinstance(doc.get("checkpoints"), list):
        raise CheckpointFormatError(
            f"{location.display} is not an ort_trainer checkpoint index (expected format {INDEX_FORMAT!r}); the "
            "manager does not write over files it did not create: move it away or choose another directory"
        )
    if not isinstance(doc.get("format_version"), int) or doc["format_version"] > INDEX_VERSION:
        raise CheckpointFormatError(f"{location.display}: index version {doc.get('format_version')!r} not supported")
    entries = [_entry(item, location.display) for item in doc["checkpoints"]]
    return {e.step: e for e in entries}


def write_index(location: Location, entries: dict[int, IndexEntry]) -> None:
    """Replace the index atomically (readers see the old one or the new one)."""
    doc = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "checkpoints": [entries[step].to_json() for step in sorted(entries)],
    }
    location.write_bytes((json.dumps(doc, indent=1) + "\n").encode("utf-8"), overwrite=True)


def scan(names: list[str]) -> dict[int, str]:
    """{step: loadable name} of the checkpoints in a folder listing: a single file, or a set's manifest."""
    found: dict[int, str] = {}
    for name in names:
        if match := _NAME.fullmatch(name):
            found.setdefault(int(match.group(1)), name)
        elif match := _MANIFEST.fullmatch(name):
            found[int(match.group(1))] = name  # a set's manifest wins over a stray single file of the same step
    return found
