"""Leftovers of killed remote saves: spool folders in TMPDIR and temporary objects in the bucket.

A remote save writes a local spool file first, then uploads it to a temporary key
``.<name>.tmp-<host>.<pid>-<8 hex>`` and moves that to the final key. A process killed on the way leaves
a full-size spool folder behind, and possibly the temporary object. Both carry their writer's host and
pid in their names, like the local temporary files of ``checkpoint.format.files``, so later saves
can tell dead leftovers from a live save's files:

* a spool folder ``ort_trainer-spool-<host>.<pid>-<random>`` of this host whose pid is not alive is
  removed by the next spool folder created (every remote save and remote load creates one);
* a temporary object is removed by the next remote save into its folder when its writer is this host's
  and not alive, or when it is older than ``REMOTE_GRACE_S`` (an object appears only once its upload is
  complete, and a live save moves it to its final key right away).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..format.files import REMOTE_GRACE_S, TEMP_RE, host_tag, pid_alive

__all__ = ["remove_stale_objects", "remove_stale_spools", "spool_prefix"]

logger = logging.getLogger(__name__)
_SPOOL = "ort_trainer-spool-"
_SPOOL_RE = re.compile(rf"^{_SPOOL}(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)-")


def spool_prefix() -> str:
    """The name prefix of this process's spool folders."""
    return f"{_SPOOL}{host_tag()}.{os.getpid()}-"


def remove_stale_spools(root: str | None = None) -> list[Path]:
    """Remove the spool folders of dead processes of this host from ``root`` (default: TMPDIR)."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _SPOOL_RE.match(entry.name)
            if match is None or match["host"] != host_tag() or pid_alive(int(match["pid"])):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    if removed:
        logger.info("removed %d spool folder(s) of killed checkpoint transfers: %s", len(removed), removed)
    return removed


def _age(info: dict[str, Any], now: float) -> float | None:
    """Seconds since the object was written, from whatever the filesystem reports (None if nothing)."""
    for key in ("LastModified", "last_modified", "mtime", "created", "updated"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            stamp = value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
            return now - stamp.timestamp()
        if isinstance(value, int | float):
            return now - float(value)
    return None


def _dead(name: str, info: dict[str, Any], now: float) -> bool:
    match = TEMP_RE.match(name)
    if match is None:
        return False
    if match["host"] == host_tag() and not pid_alive(int(match["pid"])):
        return True
    age = _age(info, now)
    return age is not None and age >= REMOTE_GRACE_S


def remove_stale_objects(fs: Any, folder: str) -> list[str]:
    """Remove the temporary objects of dead saves in the bucket folder ``folder``; never raises."""
    now, removed = time.time(), []
    try:
        entries = fs.ls(folder, detail=True, refresh=True)
    except Exception:  # a missing folder, or a listing error the save itself will report
        return []
    for info in entries:
        key = str(info.get("name", "")).rstrip("/")
        if info.get("type") == "directory" or not _dead(key.rsplit("/", 1)[-1], info, now):
            continue
        with contextlib.suppress(Exception):
            fs.rm_file(key)
            removed.append(key)
    if removed:
        logger.info("removed %d temporary object(s) of killed saves: %s", len(removed), removed)
    return removed
