"""Per-rank file names of a distributed save, and the JSON manifest that lists the files.

``save_checkpoint(path)`` on W > 1 ranks: rank r writes ``rank_checkpoint_path(path, r, W)`` =
``<stem>.rank<r>-of-<W><suffix>`` next to ``path``; after every rank has published its file
(barrier), rank 0 writes ``manifest_path(path)`` = ``<path>.manifest.json`` last, so a manifest
marks a complete save. It records each file's name (relative to the manifest), size and CRC-32
of all its bytes; :func:`check_manifest` verifies completeness and checksums.
"""

from __future__ import annotations

import json
import os
import secrets
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from ..format import schema as S
from ..format.files import fsync_path, publish

__all__ = [
    "Manifest",
    "ManifestEntry",
    "check_manifest",
    "file_crc32",
    "is_manifest",
    "manifest_bytes",
    "manifest_checksum",
    "manifest_path",
    "rank_checkpoint_path",
    "rank_file_name",
    "read_manifest",
    "split_suffix",
    "write_manifest",
]

PathLike = str | os.PathLike[str]
_CHUNK = 16 << 20
_LISTED_MISSING = 64  # missing ranks are listed one by one only up to this many beyond the files present


def rank_checkpoint_path(path: PathLike, rank: int, world_size: int, save_id: str | None = None) -> Path:
    """Rank ``rank``'s file for a save to ``path``: ``<stem>.rank<r>-of-<W>[.<save_id>]<suffix>`` (``path`` if W == 1).

    ``trainer.save_checkpoint`` gives every save its own ``save_id`` (8 hex digits of the run id), so a
    new set never overwrites the files of the set it replaces; the manifest lists the names.
    """
    path = Path(os.fspath(path))
    return path.with_name(rank_file_name(path.name, rank, world_size, save_id))


def rank_file_name(name: str, rank: int, world_size: int, save_id: str | None = None) -> str:
    """The file name part of :func:`rank_checkpoint_path` (for local paths and URLs alike)."""
    for label, value, low in (("rank", rank, 0), ("world_size", world_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{label} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    if save_id is not None and not S.SAVE_ID_RE.fullmatch(save_id):
        raise ValueError(f"save_id must be 8 to 32 lowercase hex digits, got {save_id!r}")
    if world_size == 1:
        return name
    stem, suffix = split_suffix(name)
    infix = S.RANK_FILE_INFIX.format(rank=rank, world_size=world_size) + (f".{save_id}" if save_id else "")
    return f"{stem}{infix}{suffix}"


def split_suffix(name: str) -> tuple[str, str]:
    """('ckpt', '.ortcp') for 'ckpt.ortcp', like ``Path.stem`` / ``Path.suffix`` ('.hidden' has no suffix)."""
    path = Path(name)
    return path.stem, path.suffix


def manifest_path(path: PathLike) -> Path:
    """The manifest of a distributed save to ``path``: ``<path>.manifest.json``."""
    path = Path(os.fspath(path))
    return path.with_name(path.name + S.MANIFEST_SUFFIX)


def file_crc32(path: PathLike) -> int:
    """CRC-32 (zlib) of every byte of a file, read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass(frozen=True, kw_only=True)
class ManifestEntry:
    """One rank's file: name relative to the manifest's folder, size in bytes, CRC-32 of its bytes."""

    rank: int
    name: str
    size: int
    crc32: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A validated manifest: the save's identity and its rank files in rank order."""

    path: Path
    run_id: str
    world_size: int
    step: int
    files: tuple[ManifestEntry, ...]

    def rank_paths(self) -> list[Path]:
        """Absolute-or-relative paths of the rank files, in rank order, next to the manifest."""
        return [self.path.parent / entry.name for entry in self.files]

    def to_json(self) -> dict[str, Any]:
        files = [{k: getattr(e, k) for k in S.MANIFEST_FILE_KEYS} for e in self.files]
        return {
            S.MANIFEST_FORMAT_KEY: S.MANIFEST_FORMAT_NAME,
            S.MANIFEST_FORMAT_VERSION_KEY: S.MANIFEST_FORMAT_VERSION,
            S.MANIFEST_RUN_ID_KEY: self.run_id,
            S.MANIFEST_WORLD_SIZE_KEY: self.world_size,
            S.MANIFEST_STEP_KEY: self.step,
            S.MANIFEST_FILES_KEY: files,
        }


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _entry_problems(index: int, entry: Any) -> list[str]:
    if not isinstance(entry, Mapping) or set(entry) != set(S.MANIFEST_FILE_KEYS):
        keys = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
        return [f"files[{index}]: expected keys {sorted(S.MANIFEST_FILE_KEYS)}, got {keys}"]
    problems = [f"files[{index}].{k}: expected an int >= 0" for k in ("rank", "size") if not _is_int(entry[k])]
    if not _is_int(entry[S.MANIFEST_CRC32_KEY]) or entry[S.MANIFEST_CRC32_KEY] > 0xFFFFFFFF:
        problems.append(f"files[{index}].crc32: expected an unsigned 32-bit int")
    name = entry[S.MANIFEST_NAME_KEY]
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        problems.append(f"files[{index}].name: expected a plain file name in the manifest's folder, got {name!r}")
    return problems


def _problems(data: Any) -> list[str]:
    """Every structural problem of a parsed manifest (empty if valid)."""
    if not isinstance(data, Mapping) or set(data) != set(S.MANIFEST_KEYS):
        keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        return [f"expected an object with keys {sorted(S.MANIFEST_KEYS)}, got {keys}"]
    problems = [] if isinstance(data[S.MANIFEST_RUN_ID_KEY], str) else ["run_id: expected a str"]
    problems += [] if _is_int(data[S.MANIFEST_WORLD_SIZE_KEY], 1) else ["world_size: expected an int >= 1"]
    problems += [] if _is_int(data[S.MANIFEST_STEP_KEY]) else ["step: expected an int >= 0"]
    files = data[S.MANIFEST_FILES_KEY]
    if not isinstance(files, list):
        return [*problems, "files: expected a list"]
    for i, entry in enumerate(files):
        problems += _entry_problems(i, entry)
    if problems:
        return problems
    return _rank_problems([e[S.MANIFEST_RANK_KEY] for e in files], data[S.MANIFEST_WORLD_SIZE_KEY])


def _rank_problems(ranks: list[int], world_size: int) -> list[str]:
    """Duplicate, missing and out-of-range ranks; never builds anything of size ``world_size`` (untrusted)."""
    counts = Counter(ranks)
    problems = []
    if dups := sorted(r for r, c in counts.items() if c > 1):
        problems.append(f"ranks listed more than once: {dups}")
    present = {r for r in counts if r < world_size}
    if len(present) < world_size:
        if world_size <= len(ranks) + _LISTED_MISSING:
            problems.append(f"ranks missing: {sorted(set(range(world_size)) - present)}")
        else:
            problems.append(
                f"world_size is {world_size} but only {len(ranks)} file(s) are listed: "
                f"{world_size - len(present)} ranks missing"
            )
    if extra := sorted(r for r in counts if r >= world_size):
        problems.append(f"ranks outside world_size {world_size}: {extra}")
    return problems


def read_manifest(path: PathLike) -> Manifest:
    """Parse and validate a manifest (structure only; :func:`check_manifest` also checks the files)."""
    path = Path(os.fspath(path))
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: no such manifest file")
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such manifest file (removed while it was read)") from None
    try:
        data = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # invalid JSON or UTF-8, too deep, an int of > 4300 digits
        raise CheckpointFormatError(f"{path} is not a checkpoint manifest (invalid JSON: {exc})") from None
    fmt = data.get(S.MANIFEST_FORMAT_KEY) if isinstance(data, Mapping) else None
    if fmt != S.MANIFEST_FORMAT_NAME:
        raise CheckpointFormatError(
            f"{path}: '{S.MANIFEST_FORMAT_KEY}' is {fmt!r}, expected {S.MANIFEST_FORMAT_NAME!r}"
        )
    version = data.get(S.MANIFEST_FORMAT_VERSION_KEY)
    if _is_int(version) and version > S.MANIFEST_FORMAT_VERSION:
        raise CheckpointVersionError(f"{path}: manifest version {version} is newer than {S.MANIFEST_FORMAT_VERSION}")
    fields = {k: v for k, v in data.items() if k != S.MANIFEST_CHECKSUM_KEY or version == 1}
    problems = _problems(fields) or ([] if version in (1, S.MANIFEST_FORMAT_VERSION) else [f"bad version {version!r}"])
    if problems:
        raise CheckpointFormatError(f"{path}: invalid manifest: " + "; ".join(problems))
    if version == S.MANIFEST_FORMAT_VERSION:  # a structurally valid manifest whose values were edited
        _check_checksum(path, data)
    data = fields
    entries = sorted(
        (ManifestEntry(**{k: e[k] for k in S.MANIFEST_FILE_KEYS}) for e in data["files"]), key=lambda e: e.rank
    )
    return Manifest(
        path=path,
        run_id=data[S.MANIFEST_RUN_ID_KEY],
        world_size=data[S.MANIFEST_WORLD_SIZE_KEY],
        step=data[S.MANIFEST_STEP_KEY],
        files=tuple(entries),
    )


def _check_checksum(path: Path, data: Mapping[str, Any]) -> None:
    """Version 2 manifests carry a CRC-32 of every other field: any edit (the step, a size) is damage."""
    stored = data.get(S.MANIFEST_CHECKSUM_KEY)
    if not _is_int(stored) or stored > 0xFFFFFFFF:
        raise CheckpointCorruptError(
            f"{path}: manifest field '{S.MANIFEST_CHECKSUM_KEY}' is {stored!r}, expected a CRC-32"
        )
    if (actual := manifest_checksum(data)) != stored:
        raise CheckpointCorruptError(
            f"{path}: manifest checksum mismatch ({actual:#010x} != {stored:#010x}): a manifest field was changed"
        )


def check_manifest(path: PathLike, *, checksums: bool = True) -> Manifest:
    """Read a manifest and verify that every rank file exists with its size (and CRC-32, if ``checksums``).

    Raises CheckpointCorruptError naming every missing, resized or changed file.
    """
    manifest = read_manifest(path)
    problems = []
    for entry, file in zip(manifest.files, manifest.rank_paths(), strict=True):
        where = f"rank {entry.rank} file {file}"
        try:
            if not file.is_file():
                problems.append(f"{where} is missing")
            elif (size := file.stat().st_size) != entry.size:
                problems.append(f"{where} has {size} bytes, the manifest says {entry.size}")
            elif checksums and (crc := file_crc32(file)) != entry.crc32:
                stored = f"{entry.crc32:#010x}"
                problems.append(f"{where}: CRC-32 {crc:#010x} != {stored} in the manifest (the file changed)")
        except FileNotFoundError:  # removed since is_file()
            problems.append(f"{where} is missing")
    if problems and not manifest.path.exists():  # pruned (manifest first, then its files) while we checked
        raise CheckpointNotFoundError(f"{manifest.path}: the checkpoint set was removed while it was checked")
    if problems:
        raise CheckpointCorruptError(
            f"{manifest.path}: the checkpoint set is incomplete or damaged:\n  - " + "\n  - ".join(problems)
        )
    return manifest


def is_manifest(path: PathLike) -> bool:
    """True if ``path`` names a manifest (by its suffix, or a file that starts with '{')."""
    path = Path(os.fspath(path))
    if path.name.endswith(S.MANIFEST_SUFFIX):
        return True
    if not path.is_file():  # a FIFO would block the read below
        return False
    try:
        with open(path, "rb") as fh:
            return fh.read(64).lstrip().startswith(b"{")
    except OSError:
        return False


def manifest_checksum(doc: Mapping[str, Any]) -> int:
    """CRC-32 of every field of a manifest (its canonical JSON without the checksum field)."""
    fields = {k: v for k, v in doc.items() if k != S.MANIFEST_CHECKSUM_KEY}
    return zlib.crc32(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def manifest_bytes(manifest: Manifest) -> bytes:
    """The JSON text of ``manifest``, after the same validation readers apply (ValueError listing problems)."""
    doc = manifest.to_json()
    problems = _problems(doc)
    if problems:
        raise ValueError(f"invalid manifest for {manifest.path}: " + "; ".join(problems))
    doc[S.MANIFEST_CHECKSUM_KEY] = manifest_checksum(doc)
    return (json.dumps(doc, indent=1) + "\n").encode("utf-8")


def write_manifest(
    path: PathLike,
    rank_paths: Sequence[PathLike],
    *,
    world_size: int,
    step: int,
    run_id: str,
    overwrite: bool = False,
) -> Manifest:
    """Write the manifest at ``path`` (atomically) for the rank files given in rank order.

    The files must exist and lie in the manifest's folder. Their sizes and CRC-32s are computed now.
    """
    path = Path(os.fspath(path))
    files = [Path(os.fspath(p)) for p in rank_paths]
    if len(files) != world_size:
        raise ValueError(f"expected {world_size} rank files (one per rank, in rank order), got {len(files)}")
    elsewhere = [str(f) for f in files if f.resolve().parent != path.resolve().parent]
    if elsewhere:
        raise ValueError(f"rank files must be in the manifest's folder {path.parent}: {elsewhere}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointNotFoundError(f"cannot write {path}: rank file(s) missing: {missing}")
    if path.exists() and not overwrite:
        raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
    entries = tuple(
        ManifestEntry(rank=r, name=f.name, size=f.stat().st_size, crc32=file_crc32(f)) for r, f in enumerate(files)
    )
    manifest = Manifest(path=path, run_id=run_id, world_size=world_size, step=step, files=entries)
    data = manifest_bytes(manifest)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_bytes(data)
        fsync_path(tmp, os.O_RDONLY)
        publish(tmp, path, overwrite)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return manifest
