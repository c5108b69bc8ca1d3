"""``ort-trainer-ckpt verify``: checksums, manifest completeness and rank-set coverage, one line per problem.

Checks, in order, for each manifest given: its rank files' presence, sizes and CRC-32s
(:func:`check_manifest`); then for every file: it opens (header, structure, size bounds) and every
dataset's checksum matches (:meth:`CheckpointReader.verify`), and its ``trainer_options`` (if any) are
valid; then the rank files of one save (a manifest's, or
the loose files whose ``world_size`` > 1) form one complete, consistent set: the aggregation's own
metadata-only checks (:func:`read_rank_set`, :func:`plan_aggregation`), no tensor is read.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from ..format import CheckpointReader, open_checkpoint
from ..format import schema as S
from ..format.schema import TrainerOptionsRecord
from ..sets import FileSource, Manifest, check_manifest, is_manifest, plan_aggregation, read_manifest, read_rank_set
from ._common import EXIT_ERROR, EXIT_FOUND, EXIT_OK, OUR_KINDS, PROG, input_kind, key_str
from ._remote import path_or_url

__all__ = ["VerifyReport", "add_command", "verify_paths"]

_CRC_DETAIL = re.compile(r"\(stored (\S+), computed (\S+)\)")


@dataclass
class VerifyReport:
    """What was checked (``ok`` lines) and every problem found, in the order found."""

    lines: list[tuple[str, str]] = field(default_factory=list)  # (status, text): status "ok", "note" or "FAIL"

    def ok(self, text: str) -> None:
        self.lines.append(("ok", text))

    def note(self, text: str) -> None:
        self.lines.append(("note", text))

    def fail(self, text: str) -> None:
        self.lines.append(("FAIL", text))

    @property
    def problems(self) -> list[str]:
        return [text for status, text in self.lines if status == "FAIL"]


def error_items(exc: BaseException, prefix: str = "") -> list[str]:
    """One line per listed problem of a multi-line error ('head:\\n  - a\\n  - b'), else the message."""
    parts = [line.strip() for line in str(exc).splitlines() if line.strip()]
    items = [p.removeprefix("- ") for p in parts[1:]] or parts[:1]
    return [f"{prefix}: {item}" if prefix else item for item in items]


def verify_paths(paths: Sequence[Path]) -> VerifyReport:
    """Check every manifest (with its files) and every loose file; the loose rank files as one set."""
    report = VerifyReport()
    loose = [p for p in paths if not (p.is_file() and is_manifest(p))]
    for path in paths:
        if path not in loose:
            _verify_manifest(path, report)
    with ExitStack() as stack:
        readers = [_verify_file(p, report, stack) for p in loose]
        ranked = [r for r in readers if r is not None and _world_size(r) > 1]
        if ranked:
            _verify_set(ranked, report, None, complete=None not in readers)
    return report


def _verify_manifest(path: Path, report: VerifyReport) -> None:
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        report.fail(error_items(exc)[0])
        return
    try:
        check_manifest(path)
        report.ok(f"{path}: all {manifest.world_size} rank files present, sizes and CRC-32s match")
    except CheckpointError as exc:
        for item in error_items(exc, str(path)):
            report.fail(item)
    with ExitStack() as stack:
        readers = [_verify_file(p, report, stack) for p in manifest.rank_paths() if p.is_file()]
        opened = [r for r in readers if r is not None]
        _verify_set(opened, report, manifest, complete=len(opened) == len(manifest.files))


def _verify_file(path: Path, report: VerifyReport, stack: ExitStack) -> CheckpointReader | None:
    """Open and checksum one file; return the open reader (even if some datasets are damaged), or None."""
    try:
        reader = stack.enter_context(open_checkpoint(path))
    except CheckpointError as exc:
        for item in error_items(exc):
            report.fail(item if str(path) in item else f"{path}: {item}")
        return None
    if reader.is_legacy:
        report.note(f"{path}: legacy ORTTrainer file (format version 0): no checksums to verify; structure is valid")
        return reader
    try:
        count = reader.verify()
        report.ok(f"{path}: {count} datasets, checksums match")
    except CheckpointError as exc:
        for line in _damaged_datasets(reader) or error_items(exc):
            report.fail(line)
        return reader
    _check_options(reader, report)
    return reader


def _check_options(reader: CheckpointReader, report: VerifyReport) -> None:
    """A ``trainer_options`` group must be what aggregation and ``load_checkpoint`` accept."""
    if S.TRAINER_OPTIONS_KEY not in reader:
        return
    try:
        TrainerOptionsRecord.from_tree(reader.read(S.TRAINER_OPTIONS_KEY))
    except (ValueError, TypeError) as exc:
        report.fail(f"{reader.path}: {exc}")


def _damaged_datasets(reader: CheckpointReader) -> list[str]:
    """'<file>: dataset '<key>': <what>' for every dataset whose own verify fails."""
    lines = []
    for key, _ in reader.walk():
        try:
            reader.verify(key)
        except CheckpointError as exc:
            text = str(exc).removeprefix(f"{reader.path}: ")
            match = _CRC_DETAIL.search(text)
            what = f"checksum mismatch (stored {match[1]}, computed {match[2]})" if match else text
            lines.append(f"{reader.path}: dataset '{key_str(key)}': {what}")
    return lines


def _world_size(reader: CheckpointReader) -> int:
    key = (S.TRAINER_OPTIONS_KEY, S.WORLD_SIZE_KEY)
    try:
        value = reader.read(key) if key in reader else 1
    except CheckpointError:
        return 2  # damaged metadata: let the set check report it
    return value if isinstance(value, int) else 2


def _verify_set(
    readers: Sequence[CheckpointReader], report: VerifyReport, manifest: Manifest | None, *, complete: bool
) -> None:
    """The aggregation's set checks (coverage, consistency, tiling) over rank files that all opened."""
    if not complete:  # a file already reported as missing or unreadable: the set check would only repeat it
        report.note("rank-set check skipped: a rank file is missing or unreadable (reported above)")
        return
    names = [r.path.name for r in readers]
    labels = names if len(set(names)) == len(names) else [str(r.path) for r in readers]
    where = f"rank set of {manifest.path}" if manifest else f"rank set [{', '.join(labels)}]"
    sources = [FileSource(r, label) for r, label in zip(readers, labels, strict=True)]
    try:
        rank_set = read_rank_set(sources)
        plan_aggregation(rank_set)
    except CheckpointError as exc:
        for item in error_items(exc, where):
            report.fail(item)
        return
    if manifest is not None and manifest.run_id != rank_set.run_id:
        report.fail(f"{where}: the manifest is for run_id {manifest.run_id!r} but its files hold {rank_set.run_id!r}")
        return
    report.ok(f"{where}: ranks 0..{rank_set.world_size - 1} present once each, consistent, pieces tile their tensors")


# ---- the subcommand --------------------------------------------------------------------------------
def add_command(sub: argparse._SubParsersAction, command) -> None:
    """Register ``verify`` on the CLI's subparsers."""
    p = command(
        sub,
        "verify",
        _run,
        "check checksums, manifest completeness and rank coverage; exit 1 if damaged, 2 if an input is missing or "
        "no checkpoint or manifest at all (as inspect)",
    )
    p.add_argument("paths", nargs="+", type=path_or_url, metavar="PATH", help="checkpoint files and/or manifests")


def _run(args: argparse.Namespace) -> int:
    unusable = {path: _unusable(path) for path in args.paths}
    report = verify_paths([path for path, why in unusable.items() if why is None])
    for status, text in report.lines:
        print(f"{status:<4}  {text}")
    errors = [why for why in unusable.values() if why is not None]
    for why in errors:  # as every command reports an input it cannot read (inspect exits 2 for these too)
        print(f"{PROG}: error: {why}", file=sys.stderr)
    problems = len(report.problems)
    if problems or errors:
        print(f"verify: {problems} problem(s)" + (f", {len(errors)} input(s) not verified" if errors else ""))
    else:
        print(f"verify: everything intact ({len(args.paths)} input(s))")
    return EXIT_ERROR if errors else EXIT_FOUND if problems else EXIT_OK


def _unusable(path: Path) -> str | None:
    """Why ``path`` cannot be verified at all (missing, or no checkpoint or manifest), or None."""
    try:
        kind = input_kind(path, OUR_KINDS)
    except CheckpointError as exc:
        return str(exc)
    if kind not in OUR_KINDS:
        return f"{path} is a {kind} file; verify checks checkpoints and manifests"
    return None
