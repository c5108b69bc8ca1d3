"""Walk an open HDF5 file once: refuse unsafe objects, index the tree, digest its structure.

The index is metadata only (names, shapes, dtypes, our attributes); no dataset payload is read.
The writer uses :func:`tree_digest` to stamp a file and the reader recomputes it to detect damage
to names, shapes, dtypes or attributes before any data is trusted.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from . import _schema as S
from ._codec import unescape_key
from .errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError

__all__ = ["Node", "h5_guard", "scan_file", "tree_digest"]

# Built-in HDF5 filters (deflate, shuffle, fletcher32, szip, nbit, scale-offset). Anything else is
# a plugin filter that HDF5 would look up and load as a shared library: refused.
_BUILTIN_FILTERS = frozenset({1, 2, 3, 4, 5, 6})
_MAX_DEPTH = 64
_DATASET_ATTRS = (S.ATTR_CRC32, S.ATTR_PY_TYPE, S.ATTR_TORCH_DTYPE)
# Exceptions h5py/numpy raise on damaged files; all become CheckpointCorruptError.
_H5_ERRORS = (OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError, OverflowError, SystemError,
              AttributeError, MemoryError, UnicodeError)  # fmt: skip


@contextmanager
def h5_guard(filename: str, what: str) -> Iterator[None]:
    """Turn any h5py/OS error raised inside into CheckpointCorruptError naming file and object."""
    try:
        yield
    except CheckpointError:
        raise
    except _H5_ERRORS as exc:
        raise CheckpointCorruptError(
            f"{filename}: cannot read '{what}' ({type(exc).__name__}: {exc}); the file is damaged or truncated"
        ) from exc


@dataclass
class Node:
    """One group or dataset of the file: HDF5 name, original key path, and metadata."""

    h5path: str
    key: tuple[str, ...]
    is_group: bool
    children: dict[str, Node] = field(default_factory=dict)  # original (unescaped) name -> node
    shape: tuple[int, ...] | None = None  # None for an empty (null-dataspace) dataset
    dtype: np.dtype | None = None
    attrs: dict[str, Any] = field(default_factory=dict)  # our dataset attributes only
    dataset: h5py.Dataset | None = None

    @property
    def keypath(self) -> str:
        return "/".join(self.key) or "/"


def _attr_value(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _check_dataset(ds: h5py.Dataset, h5path: str, filename: str, file_size: int) -> None:
    """Refuse datasets that read other files or load plugins; catch sizes larger than the file."""
    if ds.is_virtual:
        raise CheckpointFormatError(f"{filename}: refusing virtual dataset '{h5path}' (it reads other files)")
    if ds.external:
        raise CheckpointFormatError(
            f"{filename}: refusing dataset '{h5path}' with external storage {[e[0] for e in ds.external]}"
        )
    plist = ds.id.get_create_plist()
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    if any(f not in _BUILTIN_FILTERS for f in filters):
        raise CheckpointFormatError(f"{filename}: refusing dataset '{h5path}' with non-builtin HDF5 filter {filters}")
    if ds.shape is not None and not filters and ds.dtype.kind != "O":
        nbytes = math.prod(ds.shape) * ds.dtype.itemsize
        if nbytes > file_size:
            raise CheckpointCorruptError(
                f"{filename}: dataset '{h5path}' claims {nbytes} bytes but the file has only {file_size}"
            )


class _Scanner:
    """Recursive walk holding the file name (for messages), the mode and the visited groups."""

    def __init__(self, filename: str, ours: bool, file_size: int) -> None:
        self.filename, self.ours, self.file_size = filename, ours, file_size
        self.visited: set[Any] = set()

    def name(self, h5name: str) -> str:
        return unescape_key(h5name) if self.ours else h5name

    def group(self, group: h5py.Group, node: Node, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise CheckpointFormatError(f"{self.filename}: groups nested deeper than {_MAX_DEPTH} at '{node.h5path}'")
        with h5_guard(self.filename, node.h5path):
            if group.id in self.visited:
                raise CheckpointFormatError(f"{self.filename}: group '{node.h5path}' is linked twice (a cycle)")
            self.visited.add(group.id)
            names = sorted(group.keys())
        for h5name in names:
            self.child(group, h5name, node, depth)

    def child(self, group: h5py.Group, h5name: str, parent: Node, depth: int) -> None:
        h5path = f"{parent.h5path.rstrip('/')}/{h5name}"
        with h5_guard(self.filename, h5path):
            link = group.get(h5name, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise CheckpointFormatError(
                    f"{self.filename}: refusing external link '{h5path}' -> {link.filename}:{link.path}"
                )
            if not isinstance(link, h5py.HardLink):
                target = getattr(link, "path", type(link).__name__)
                raise CheckpointFormatError(f"{self.filename}: refusing soft/user link '{h5path}' -> {target}")
            obj = group[h5name]
            node = Node(h5path, (*parent.key, self.name(h5name)), isinstance(obj, h5py.Group))
            if isinstance(obj, h5py.Dataset):
                _check_dataset(obj, h5path, self.filename, self.file_size)
                node.shape, node.dtype, node.dataset = obj.shape, obj.dtype, obj
                if self.ours:
                    node.attrs = {k: _attr_value(obj.attrs[k]) for k in _DATASET_ATTRS if k in obj.attrs}
            elif not node.is_group:
                raise CheckpointFormatError(f"{self.filename}: refusing object '{h5path}' of type {type(obj).__name__}")
        if node.key[-1] in parent.children:
            raise CheckpointCorruptError(f"{self.filename}: two objects decode to the same key '{node.keypath}'")
        parent.children[node.key[-1]] = node
        if node.is_group:
            self.group(obj, node, depth + 1)


def scan_file(h5file: h5py.File, filename: str, *, ours: bool, file_size: int) -> Node:
    """Index every object under the root, refusing links, external/virtual data and plugin filters."""
    root = Node("/", (), True)
    _Scanner(filename, ours, file_size).group(h5file, root, 0)
    return root


def _lines(node: Node) -> Iterator[str]:
    for name in sorted(node.children):
        child = node.children[name]
        attrs = ",".join(f"{k}={child.attrs[k]!r}" for k in sorted(child.attrs))
        if child.is_group:
            yield f"G {child.h5path}"
            yield from _lines(child)
        else:
            dtype = None if child.dtype is None else child.dtype.str
            yield f"D {child.h5path} {child.shape} {dtype} {attrs}"


def tree_digest(root: Node, root_attrs: dict[str, Any]) -> int:
    """CRC-32 of the tree's structure: every path, shape, dtype, our attributes and root attributes."""
    head = [f"{k}={root_attrs.get(k)!r}" for k in S.ROOT_ATTRS if k != S.ATTR_TREE_CRC32]
    return zlib.crc32("\n".join([*head, *_lines(root)]).encode("utf-8"))
