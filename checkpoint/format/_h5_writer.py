"""Atomic HDF5 save of a nested mapping (see FORMAT.md for the layout it produces).

Call order inside :func:`save`: validate and encode the whole tree (no file touched), check the target
once, then (:func:`._atomic.atomic_file`) remove stale temporary files of killed saves in the folder,
create and lock a temporary file in the target folder, write it (groups and datasets through HDF5, array bytes
written and checksummed in one pass, root attributes and the structure digest, the header), fsync it,
publish it under the final name with one atomic step, fsync the folder. Any failure removes the
temporary file and leaves an old file intact; a full disk raises CheckpointWriteError.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
from h5py import h5d, h5g

from . import _h5_lowlevel as ll
from . import files
from ._atomic import CHECKSUM, RawWriter, atomic_file, checkpoint_body
from ._codec import STR_DTYPE, Leaf, encode_leaf, escape_key, leaf_array
from ._h5_index import Node
from ._tempfile import remove_stale_temp_files

__all__ = ["check_target", "cleanup_temp_files", "plan_tree", "save", "save_to_checked_target", "write_leaf"]

Entry = tuple[str, str, Leaf | None]  # (absolute HDF5 path, original key, leaf); leaf None = group


def plan_tree(tree: Mapping[str, Any]) -> list[Entry]:
    """Validate and encode every key and leaf (TypeError/ValueError naming the key path)."""
    if not isinstance(tree, Mapping):
        raise TypeError(f"a checkpoint tree must be a Mapping (e.g. a dict), got {type(tree).__name__}")
    entries: list[Entry] = []
    _plan(tree, "", (), entries, set())
    return entries


def _plan(tree: Mapping, h5prefix: str, keypath: tuple[str, ...], entries: list[Entry], active: set[int]) -> None:
    if id(tree) in active:
        raise ValueError(f"the tree contains a reference cycle at '{'/'.join(keypath)}'")
    active.add(id(tree))
    for key, value in tree.items():
        where = "/".join((*keypath, str(key)))
        if not isinstance(key, str):
            raise TypeError(f"keys must be str, got {type(key).__name__} {key!r} at '{where}'")
        if not key:
            raise ValueError(f"empty key at '{where}': HDF5 cannot store an empty name")
        h5path = f"{h5prefix}/{escape_key(key)}"
        if isinstance(value, Mapping):
            entries.append((h5path, key, None))
            _plan(value, h5path, (*keypath, key), entries, active)
        else:
            entries.append((h5path, key, encode_leaf(value, where)))
    active.discard(id(tree))


def write_leaf(parent: h5g.GroupID, name: str, leaf: Leaf, raw: RawWriter) -> tuple[h5d.DatasetID, dict[str, Any]]:
    """Create one dataset, write its bytes with their checksum, and its attributes; return it and them."""
    data = leaf_array(leaf)
    if isinstance(data, str) or (isinstance(data, list) and data):
        dsid = h5py.Group(parent).create_dataset(name, data=data, dtype=STR_DTYPE).id
        crc = CHECKSUM.strings(data)
    else:
        dsid = ll.create_array(parent, name, data)
        crc = 0 if isinstance(data, h5py.Empty) else raw.write(dsid, data)
    attrs = {**leaf.attrs, CHECKSUM.attr: crc}
    for attr, value in attrs.items():
        ll.write_attr(dsid, attr, value)
    return dsid, attrs


def _write_tree(f: h5py.File, raw: RawWriter, entries: list[Entry]) -> Node:
    """Create every group and dataset; return the index the reader would build."""
    root = Node("/", (), True)
    groups: dict[str, tuple[h5g.GroupID, Node]] = {"": (h5g.open(f.id, b"/"), root)}
    for h5path, key, leaf in entries:
        parent_path, _, name = h5path.rpartition("/")
        parent_id, parent = groups[parent_path]
        if leaf is None:
            node = Node(h5path, (), True)
            groups[h5path] = (ll.create_group(parent_id, name), node)
        else:
            dsid, attrs = write_leaf(parent_id, name, leaf, raw)
            shape = None if isinstance(leaf.data, h5py.Empty) else dsid.shape
            node = Node(h5path, (), False, shape=shape, dtype=dsid.dtype, attrs=attrs)
        parent.children[key] = node
    return root


def check_target(path: Path, overwrite: bool) -> None:
    """:func:`.files.check_target` for a local path (a folder that cannot be created names the path)."""
    files.check_target(
        str(path), is_dir=path.is_dir, make_parent=lambda: _make_parent(path), exists=path.exists, overwrite=overwrite
    )


def _make_parent(path: Path) -> None:
    if not path.parent.is_dir():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise type(exc)(
                exc.errno, f"cannot save {path}: cannot create its folder ({exc.strerror})", str(path.parent)
            ) from None


def save(tree: Mapping[str, Any], path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Write a nested mapping to an HDF5 checkpoint at ``path``, atomically.

    Mappings become groups; leaves may be CPU/GPU torch tensors (any dtype, bfloat16 and float8
    stored as their bits), numpy arrays and scalars, int, float, bool, str, bytes, None, and
    lists/tuples of one scalar type. Keys must be non-empty str; '/' and '%' in keys are
    percent-encoded. Every dataset carries a CRC-32C, the root a digest of the structure, and a
    header in the HDF5 user block a checksum of all metadata (see FORMAT.md).
    Readers see the old file or the new one, never a partial one. A killed save leaves a hidden
    ``.<name>.tmp-<host>.<pid>-<hex>`` file; the next save into the folder removes it (only files that
    no live writer holds, see :func:`cleanup_temp_files`).

    Raises TypeError/ValueError naming the key path for unsupported content (before any file is
    created), CheckpointExistsError if ``path`` exists and ``overwrite`` is False, and
    CheckpointWriteError (an OSError with ``errno``, e.g. ENOSPC or EFBIG) if the device is full or
    another I/O error stops the save.
    """
    path = Path(os.fspath(path))
    entries = plan_tree(tree)
    check_target(path, overwrite)
    _commit(entries, path, overwrite)


def save_to_checked_target(tree: Mapping[str, Any], path: Path, *, overwrite: bool) -> None:
    """:func:`save` to a target the caller has checked already (the trainer's save scheduler checks it on
    the calling thread, before a background write), so that each save checks its target once. A file
    that appeared meanwhile is still never replaced without ``overwrite`` (the atomic publish refuses)."""
    _commit(plan_tree(tree), path, overwrite)


def _commit(entries: list[Entry], path: Path, overwrite: bool) -> None:
    """Write the planned entries into a locked temporary file and publish it as ``path``."""
    leaves = sum(leaf is not None for _, _, leaf in entries)
    with atomic_file(path, overwrite) as tmp, checkpoint_body(tmp, leaves) as body:
        body.root = _write_tree(body.file, body.raw, entries)


def cleanup_temp_files(folder: str | os.PathLike[str], *, older_than_s: float = 0.0) -> list[Path]:
    """Remove temporary files left in ``folder`` by saves that were killed; return what was removed.

    Only names of the form ``.<name>.tmp-<host>.<pid>-<8 hex>`` (or the older ``.<name>.tmp-<pid>-<8 hex>``)
    are touched, and only when their writer is gone: no process holds the file's lock, and its pid is not
    alive on this host (a file from another host: unmodified for ``_tempfile.REMOTE_GRACE_S``).
    ``older_than_s`` additionally spares files modified within that many seconds. Every save does
    this for its own folder.
    """
    return remove_stale_temp_files(Path(os.fspath(folder)), older_than_s=older_than_s)
