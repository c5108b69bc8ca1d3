"""Atomic HDF5 save of a tree produced one value at a time (for aggregation to a file).

Same file as :func:`checkpoint.save` writes (same datasets, checksums, digest, header, atomic
publish), built from the writer's own pieces. The difference: values come from an iterator of
``(key path, value)`` in tree order and each one is fully written (its bytes and their checksum, in
one pass) before the next is requested, so peak memory is one value, not the tree, and the producer
may reuse one buffer for all values.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
from h5py import h5g

from . import _h5_lowlevel as ll
from ._atomic import RawWriter, atomic_file, checkpoint_body
from ._codec import encode_leaf, escape_key
from ._h5_index import Node
from ._h5_writer import check_target, write_leaf

__all__ = ["save_stream"]

Key = tuple[str, ...]


def _write_items(f: h5py.File, raw: RawWriter, items: Iterable[tuple[Key, Any]]) -> Node:
    """Create each group and dataset as it arrives; return the index."""
    root = Node("/", (), True)
    groups: dict[Key, tuple[h5g.GroupID, Node]] = {(): (h5g.open(f.id, b"/"), root)}
    for key, value in items:
        parent_id, parent = groups[key[:-1]]
        name = escape_key(key[-1])
        h5path = f"{parent.h5path.rstrip('/')}/{name}"
        if isinstance(value, Mapping):
            node = Node(h5path, (), True)
            groups[key] = (ll.create_group(parent_id, name), node)
        else:
            leaf = encode_leaf(value, "/".join(key))
            dsid, attrs = write_leaf(parent_id, name, leaf, raw)
            shape = None if isinstance(leaf.data, h5py.Empty) else dsid.shape
            node = Node(h5path, (), False, shape=shape, dtype=dsid.dtype, attrs=attrs)
            del leaf
        del value  # release this value before the iterator produces the next one
        parent.children[key[-1]] = node
    return root


def save_stream(
    items: Iterable[tuple[Key, Any]], path: str | os.PathLike[str], *, max_leaves: int, overwrite: bool = False
) -> Path:
    """Write ``(key path, value)`` pairs (tree order; an empty mapping announces a group) atomically.

    ``max_leaves`` bounds the number of values (it sizes the header). An exception raised by the
    iterator removes the temporary file and leaves an existing ``path`` untouched; a full disk raises
    CheckpointWriteError.
    """
    path = Path(os.fspath(path))
    check_target(path, overwrite)
    with atomic_file(path, overwrite) as tmp, checkpoint_body(tmp, max_leaves) as body:
        body.root = _write_items(body.file, body.raw, items)
    return path
