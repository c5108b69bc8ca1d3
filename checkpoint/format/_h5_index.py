"""Walk an open HDF5 file once: refuse unsafe objects (``_h5_checks``), index the tree, digest its structure.

The index is metadata only (names, shapes, dtypes, our attributes); no dataset payload is read.
The writer builds the same index while writing and stamps :func:`tree_digest` into the file; the
reader recomputes it, for files without a verified header, to detect damage to names, shapes,
dtypes or attributes before any data is trusted.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5g

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError
from . import _h5_lowlevel as ll
from . import schema as S
from ._codec import unescape_key
from ._h5_checks import StorageCheck, check_attrs

__all__ = ["Node", "h5_guard", "load_attrs", "scan_file", "tree_digest"]

_MAX_DEPTH = 64
# Exceptions h5py/numpy raise on damaged files; all become CheckpointCorruptError.
_H5_ERRORS = (
    OSError,
    RuntimeError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    OverflowError,
    SystemError,
    AttributeError,
    MemoryError,
    UnicodeError,
)


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
    attrs: dict[str, Any] | None = None  # our dataset attributes; None until read (see load_attrs)
    dataset: h5d.DatasetID | None = None  # low-level id: h5py.Dataset(node.dataset) for the high-level API

    @property
    def keypath(self) -> str:
        return "/".join(self.key) or "/"


class _Scanner:
    """Recursive walk holding the file name (for messages), the mode and the visited groups."""

    def __init__(self, filename: str, ours: bool, checks: StorageCheck, eager_attrs: str | None) -> None:
        self.filename, self.ours, self.checks, self.eager_attrs = filename, ours, checks, eager_attrs
        self.visited: set[Any] = set()

    def name(self, h5name: str) -> str:
        return unescape_key(h5name) if self.ours else h5name

    def group(self, gid: h5g.GroupID, node: Node, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise CheckpointFormatError(f"{self.filename}: groups nested deeper than {_MAX_DEPTH} at '{node.h5path}'")
        with h5_guard(self.filename, node.h5path):
            if gid in self.visited:
                raise CheckpointFormatError(f"{self.filename}: group '{node.h5path}' is linked twice (a cycle)")
            self.visited.add(gid)
            children = ll.links(gid)
        for bname, kind in children:
            self.child(gid, bname, kind, node, depth)

    def child(self, gid: h5g.GroupID, bname: bytes, kind: int, parent: Node, depth: int) -> None:
        h5name = bname.decode("utf-8", "surrogateescape")
        h5path = f"{parent.h5path.rstrip('/')}/{h5name}"
        with h5_guard(self.filename, h5path):
            if kind != ll.HARD_LINK:
                what = "external" if kind == ll.EXTERNAL_LINK else "soft/user"
                target = ll.link_target(gid, bname) if kind in (ll.SOFT_LINK, ll.EXTERNAL_LINK) else "?"
                raise CheckpointFormatError(f"{self.filename}: refusing {what} link '{h5path}' -> {target}")
            obj = ll.open_object(gid, bname)
            node = Node(h5path, (*parent.key, self.name(h5name)), isinstance(obj, h5g.GroupID))
            if isinstance(obj, h5d.DatasetID):
                node.shape, node.dtype = self.checks.dataset(obj, h5path)
                node.dataset = obj
                if not self.ours:
                    node.attrs = {}
                elif self.eager_attrs:
                    load_attrs(node, self.filename, self.eager_attrs)
            elif not node.is_group:
                raise CheckpointFormatError(f"{self.filename}: refusing object '{h5path}' of type {type(obj).__name__}")
        if node.key[-1] in parent.children:
            raise CheckpointCorruptError(f"{self.filename}: two objects decode to the same key '{node.keypath}'")
        parent.children[node.key[-1]] = node
        if node.is_group:
            self.group(obj, node, depth + 1)


def scan_file(h5file: h5py.File, filename: str, *, ours: bool, file_size: int, eager_attrs: str | None) -> Node:
    """Index every object under the root, refusing links and datasets that :class:`StorageCheck` refuses.

    Dataset attributes are read now only with ``eager_attrs`` (the checksum attribute's name; needed for
    :func:`tree_digest`); otherwise :func:`load_attrs` reads them when a dataset is first used (saves
    ~40% of the open time for checkpoints with thousands of small tensors).
    """
    root = Node("/", (), True)
    with h5_guard(filename, "/"):
        root_id = h5g.open(h5file.id, b"/")
    checks = StorageCheck(filename, file_size, fd=_descriptor(h5file))
    try:
        _Scanner(filename, ours, checks, eager_attrs).group(root_id, root, 0)
    finally:
        checks.close()
    return root


def load_attrs(node: Node, filename: str, checksum_attr: str) -> dict[str, Any]:
    """The dataset's attributes (ours only), read once, checked against its data and cached on the node.

    ``checksum_attr`` names the checksum attribute of the file's format version (``crc32c`` or ``crc32``).
    """
    if node.attrs is None:
        with h5_guard(filename, node.h5path):
            attrs = ll.read_attrs(node.dataset, (checksum_attr, S.ATTR_PY_TYPE, S.ATTR_TORCH_DTYPE))
        check_attrs(attrs, node.shape, node.dtype, f"{filename}: dataset '{node.h5path}'", checksum_attr)
        node.attrs = attrs
    return node.attrs


def _lines(node: Node) -> Iterator[str]:
    for name in sorted(node.children):
        child = node.children[name]
        attrs = ",".join(f"{k}={v!r}" for k, v in sorted((child.attrs or {}).items()))
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


def _descriptor(h5file: h5py.File) -> int | None:
    """The descriptor HDF5 reads ``h5file`` through (the sec2 driver's); None for a driver without one."""
    try:
        handle = h5file.id.get_vfd_handle()
    except (RuntimeError, ValueError, TypeError, OSError):
        return None
    return handle if isinstance(handle, int) and handle >= 0 else None
