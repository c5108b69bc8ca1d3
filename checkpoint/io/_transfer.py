"""Moving checkpoint files between the local writer/reader and a :class:`Location`.

Writing: a local target is written in place by the atomic ``checkpoint.save`` (temp file next to
it, fsync, atomic rename). A remote target is written to a local spool file first (the HDF5 writer
needs a seekable file), then uploaded to a temporary key and moved to its final key.

Reading: :func:`local_inputs` gives local paths for what the readers open; remote files are
downloaded into a temporary spool folder first (a remote manifest brings its rank files along),
which is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..format import save
from ..sets import Manifest, file_crc32, read_manifest
from ._location import Location, RemoteLocation, is_url, resolve, storage_errors
from ._stale import remove_stale_spools, spool_prefix

__all__ = [
    "FileRecord",
    "local_inputs",
    "make_parent_folder",
    "read_manifest_at",
    "save_tree",
    "spool_folder",
    "write_file",
]

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class FileRecord:
    """A published file: its name (in its folder), size in bytes and CRC-32 of all its bytes."""

    name: str
    size: int
    crc32: int


@contextlib.contextmanager
def spool_folder() -> Iterator[Path]:
    """A private temporary folder for files on their way to or from remote storage (named after this
    process: the next one removes it if this process is killed, see ``_stale``)."""
    remove_stale_spools()
    with tempfile.TemporaryDirectory(prefix=spool_prefix()) as folder:
        yield Path(folder)


def make_parent_folder(target: Location) -> None:
    """Create the folder ``target`` goes into (and its parents), as DCP and orbax do before a save.

    Called where a save is requested (not on a background thread), so ``runs/exp1/step1.ortcp`` works in a
    fresh ``runs/``. An fsspec folder is made with ``fs.makedirs`` (a no-op on stores without folders).
    A failure (permissions, a file in the way) is raised as the same ``OSError`` type naming the folder.
    """
    folder = target.folder()
    if not target.remote:
        if folder.path.is_dir():
            return
        try:
            folder.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise type(exc)(
                exc.errno, f"cannot save {target.display}: cannot create its folder ({exc.strerror})", folder.display
            ) from None
        return
    folder.make_dirs()


def save_tree(tree: Mapping[str, Any], target: Location, *, overwrite: bool) -> None:
    """``checkpoint.save`` to a local path or a URL, with the same all-or-nothing guarantee."""
    if not target.remote:
        save(tree, target.path, overwrite=overwrite)
        return
    write_file(tree, target, overwrite=overwrite, record=False)


def write_file(tree: Mapping[str, Any], target: Location, *, overwrite: bool, record: bool = True) -> FileRecord | None:
    """Save ``tree`` at ``target``; with ``record``, also return its size and whole-file CRC-32 (for manifests)."""
    if not target.remote:
        save(tree, target.path, overwrite=overwrite)
        if not record:
            return None
        return FileRecord(target.name, target.path.stat().st_size, file_crc32(target.path))
    target.refuse_existing(overwrite)
    with spool_folder() as folder:
        local = folder / target.name
        save(tree, local)
        result = FileRecord(target.name, local.stat().st_size, file_crc32(local)) if record else None
        target.publish_file(local, overwrite=overwrite)
    return result


def _fetch(loc: RemoteLocation, folder: Path, index: int) -> Path:
    """Download ``loc`` into ``folder/<index>/<name>`` (a subfolder each: names of different prefixes may clash)."""
    sub = folder / str(index)
    sub.mkdir()
    local = sub / loc.name
    loc.fetch_to(local)
    return local


def _fetch_manifest(loc: RemoteLocation, folder: Path) -> Path:
    """Download a manifest and every rank file it lists into one folder, under their own names."""
    sub = folder / "manifest"
    sub.mkdir()
    local = sub / loc.name
    loc.fetch_to(local)
    for entry in read_manifest(local).files:
        loc.sibling(entry.name).fetch_to(sub / entry.name)
    return local


def read_manifest_at(location: Location) -> Manifest:
    """Parse and validate the manifest at a local path or URL (its rank files are not fetched)."""
    if not location.remote:
        return read_manifest(location.path)
    with spool_folder() as folder:
        local = folder / location.name
        local.write_bytes(location.read_bytes())
        return read_manifest(local)


@contextlib.contextmanager
def local_inputs(
    paths: PathLike | Sequence[PathLike], storage_options: Mapping[str, Any] | None = None
) -> Iterator[Any]:
    """``paths`` (one or a sequence) with every remote URL replaced by a downloaded local copy.

    The copies live in a temporary folder removed on exit. Local paths and ``file://`` URLs pass through.
    """
    single = isinstance(paths, str | os.PathLike) or isinstance(paths, Location)
    items = [paths] if single else list(paths)
    if not any(is_url(p) or (isinstance(p, Location) and p.remote) for p in items):
        local = [p.path if isinstance(p, Location) else p for p in items]
        yield local[0] if single else local
        return
    with spool_folder() as folder:
        local: list[Any] = []
        for index, item in enumerate(items):
            loc = resolve(item, storage_options)
            if not loc.remote:
                local.append(loc.path)
            elif loc.name.endswith(".manifest.json") or _remote_is_manifest(loc):
                local.append(_fetch_manifest(loc, folder))
            else:
                local.append(_fetch(loc, folder, index))
        yield local[0] if single else local


def _remote_is_manifest(loc: RemoteLocation) -> bool:
    """A manifest by content (starts with '{'), read from the object's first bytes."""
    with storage_errors(loc.display, "read"):
        head = bytes(loc.fs.cat_file(loc.key, start=0, end=64))
    return head.lstrip().startswith(b"{")
