"""Validated, checksummed reading of HDF5 checkpoints (ours and the legacy ORTTrainer's).

Opening validates in this order: file exists, is HDF5, opens, root attributes (format name and
version), every object is safe (no links, external or virtual data, filters; sizes bounded by the file), the structure
digest matches. Only then is any payload read, and each payload is checked against its checksum
(CRC-32C since format version 2, CRC-32 in version 1).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5s

from ..errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointVersionError,
)
from . import schema as S
from ._checksum import PendingChecks as _Checksums
from ._checksum import for_version, streamed_checksum
from ._codec import BITS_DTYPE_NAMES, bits_dtype_names, decode_python_value, numpy_dtype_name
from ._h5_index import Node, h5_guard, load_attrs, scan_file, tree_digest
from ._h5_open import open_h5
from .lazy_torch import is_torch_dtype, torch

__all__ = ["CheckpointReader", "DatasetInfo", "Key", "load", "open_checkpoint", "split_key"]

Key = str | Sequence[str] | None
_ARRAY_TYPES = frozenset({S.PY_TENSOR, S.PY_NDARRAY, S.PY_NUMPY_SCALAR})
_PY_CLASSES = {
    S.PY_INT: int,
    S.PY_FLOAT: float,
    S.PY_BOOL: bool,
    S.PY_STR: str,
    S.PY_BYTES: bytes,
    S.PY_NONE: type(None),
    S.PY_LIST: list,
    S.PY_TUPLE: tuple,
}
_VERIFY_CHUNK_BYTES = 4 << 20  # pieces that stay in cache between the read and the checksum


class DatasetInfo:
    """Shape and type of a stored value, known without reading it.

    ``dtype`` is a ``torch.dtype`` for array data (loaded as tensors) and the python type
    (``int``, ``str``, ``list``, ...) for values that load as python objects. The reader gives an
    array's dtype by name and ``dtype`` resolves it on first access, so describing a file
    (``is_array``, ``dtype_name``, ``nbytes``) does not import torch.
    """

    __slots__ = ("_dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype | type | str) -> None:
        self.shape = tuple(shape)
        self._dtype = dtype  # a str is the name of a torch dtype ('float32', 'bfloat16')

    @property
    def dtype(self) -> torch.dtype | type:
        if isinstance(self._dtype, str):
            self._dtype = getattr(torch, self._dtype)
        return self._dtype

    @property
    def is_array(self) -> bool:
        """True for array data (loaded as a tensor), False for python values."""
        return isinstance(self._dtype, str) or is_torch_dtype(self._dtype)

    @property
    def dtype_name(self) -> str:
        """'float32' for arrays (torch's name without 'torch.'), the type's name ('int', 'NoneType') otherwise."""
        if isinstance(self._dtype, str):
            return self._dtype
        return str(self._dtype).removeprefix("torch.") if self.is_array else self._dtype.__name__

    @property
    def nbytes(self) -> int | None:
        """Bytes of array data (numel * itemsize); None for python values."""
        if not self.is_array:
            return None
        return math.prod(self.shape) * np.dtype(BITS_DTYPE_NAMES.get(self.dtype_name, self.dtype_name)).itemsize

    def _key(self) -> tuple[bool, tuple[int, ...], str]:
        return self.is_array, self.shape, self.dtype_name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple):  # it was a NamedTuple: (shape, dtype) compares equal
            return len(other) == 2 and tuple(self) == other
        return isinstance(other, DatasetInfo) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __iter__(self) -> Iterator[Any]:  # shape, dtype = info (it was a NamedTuple)
        return iter((self.shape, self.dtype))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return (self.shape, self.dtype)[index]

    def __repr__(self) -> str:
        dtype = f"torch.{self.dtype_name}" if self.is_array else self.dtype_name
        return f"DatasetInfo(shape={self.shape}, dtype={dtype})"


def split_key(key: Key) -> tuple[str, ...]:
    """'a/b' -> ('a', 'b'); a tuple/list of names addresses keys that themselves contain '/'."""
    if key is None:
        return ()
    if isinstance(key, str):
        return tuple(part for part in key.split("/") if part)
    return tuple(key)


def _format_version(path: Path, attrs: dict[str, Any]) -> int:
    """Check the root attributes: 0 for a legacy file, else our (supported) format version."""
    if not attrs:
        return S.LEGACY_FORMAT_VERSION
    fmt, version = attrs.get(S.ATTR_FORMAT), attrs.get(S.ATTR_FORMAT_VERSION)
    kinds = {S.ATTR_FORMAT: str, S.ATTR_FORMAT_VERSION: int, S.ATTR_LIBRARY_VERSION: str, S.ATTR_TREE_CRC32: int}
    for name, kind in kinds.items():
        value = attrs.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            shown = f"{type(value).__name__} {value!r}"[:120]
            raise CheckpointCorruptError(f"{path}: root attribute {name} is {shown}, expected a {kind.__name__}")
    if isinstance(version, int) and version > S.FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path} has checkpoint format version {version}, newer than the newest this library reads "
            f"({S.FORMAT_VERSION}); upgrade ort_trainer to read it"
        )
    if fmt is not None and fmt != S.FORMAT_NAME:
        raise CheckpointFormatError(f"{path}: root attribute {S.ATTR_FORMAT}={fmt!r}, expected {S.FORMAT_NAME!r}")
    missing = sorted(set(S.ROOT_ATTRS) - set(attrs))
    if missing or version not in S.SUPPORTED_FORMAT_VERSIONS:
        raise CheckpointCorruptError(
            f"{path}: damaged root attributes ({S.ATTR_FORMAT_VERSION}={version!r}, missing {missing})"
        )
    return version


class CheckpointReader:
    """An open checkpoint: inspect its tree without reading data, then read all of it or pieces.

    Use as a context manager (or call :meth:`close`). Array data loads as CPU ``torch.Tensor``;
    python scalars, strings, bytes, None, lists and tuples load as those python types. Legacy
    ORTTrainer files (no format attributes, ``format_version == 0``) load too, without checksums:
    their 0-d numeric datasets come back as python scalars and their strings as ``str``.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        self.path = Path(os.fspath(path))
        self.verify_checksums = verify
        self._verified_stat: tuple[int, ...] | None = None  # the file as a full verify() saw it (see _new_checks)
        self._as_numpy: bool | str = False  # read(as_numpy=True) / verify() ("raw") for the duration of the call
        self._file, has_header, size = open_h5(self.path, verify)
        try:
            with h5_guard(str(self.path), "/ (root attributes)"):
                names = set(self._file.attrs.keys())
                attrs = {k: self._file.attrs[k] for k in S.ROOT_ATTRS if k in names}
                self.attrs: dict[str, Any] = {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
            self.format_version = _format_version(self.path, self.attrs)
            self.checksum = for_version(self.format_version)  # None for legacy files
            self._checksum_attr = self.checksum.attr if self.checksum else S.ATTR_CRC32C
            # The structure digest is needed only when no verified header already covered the metadata.
            digest = verify and not self.is_legacy and not has_header
            self._root = scan_file(
                self._file,
                str(self.path),
                ours=not self.is_legacy,
                file_size=size,
                eager_attrs=self._checksum_attr if digest else None,
            )
            if digest and tree_digest(self._root, self.attrs) != self.attrs[S.ATTR_TREE_CRC32]:
                raise CheckpointCorruptError(
                    f"{self.path}: structure checksum mismatch: names, shapes, dtypes or attributes are damaged"
                )
        except BaseException:
            self._file.close()
            raise

    @property
    def is_legacy(self) -> bool:
        """True for files written by the legacy ORTTrainer (no format attributes, no checksums)."""
        return self.format_version == S.LEGACY_FORMAT_VERSION

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- navigation and metadata -----------------------------------------------------------------
    def _attrs(self, node: Node) -> dict[str, Any]:
        """Our attributes of a dataset, checked against its data (CheckpointCorruptError if they disagree)."""
        return load_attrs(node, str(self.path), self._checksum_attr)

    def _node(self, key: Key) -> Node:
        node, parts = self._root, split_key(key)
        for depth, part in enumerate(parts):
            where = "/".join(parts[:depth]) or "the root"
            if not node.is_group:
                raise CheckpointKeyError(f"'{'/'.join(parts)}' not found in {self.path}: '{where}' is a value")
            if part not in node.children:
                raise CheckpointKeyError(
                    f"'{'/'.join(parts)}' not found in {self.path}: {where} has keys {sorted(node.children)}"
                )
            node = node.children[part]
        return node

    def __contains__(self, key: Key) -> bool:
        try:
            self._node(key)
        except CheckpointKeyError:
            return False
        return True

    def keys(self, prefix: Key = "") -> list[str]:
        """Sorted names (original, unescaped) directly under the group ``prefix``."""
        node = self._node(prefix)
        if not node.is_group:
            raise CheckpointKeyError(f"'{node.keypath}' in {self.path} is a value, not a group")
        return sorted(node.children)

    def _info(self, node: Node) -> DatasetInfo:
        shape = () if node.shape is None else tuple(node.shape)
        py_type = self._attrs(node).get(S.ATTR_PY_TYPE)
        if not self.is_legacy and py_type in _PY_CLASSES:
            return DatasetInfo(shape if py_type in (S.PY_LIST, S.PY_TUPLE) else (), _PY_CLASSES[py_type])
        if self.is_legacy and (node.shape in (None, ()) or node.dtype.kind in "OSU"):
            kind = {"b": bool, "i": int, "u": int, "f": float, "c": complex}.get(node.dtype.kind, str)
            return DatasetInfo(shape, type(None) if node.shape is None else kind)
        return DatasetInfo(shape, self._dtype_names(node)[0])

    def tree_info(self, key: Key = None) -> dict[str, Any] | DatasetInfo:
        """Nested dict of :class:`DatasetInfo` for the subtree at ``key`` (no data is read)."""
        node = self._node(key)
        if not node.is_group:
            return self._info(node)
        return {name: self.tree_info((*node.key, name)) for name in node.children}

    def walk(self, prefix: Key = None) -> Iterator[tuple[tuple[str, ...], DatasetInfo]]:
        """Yield (key path tuple, info) for every dataset under ``prefix``, in sorted order."""
        stack = [self._node(prefix)]
        while stack:
            node = stack.pop()
            if not node.is_group:
                yield node.key, self._info(node)
            else:
                stack.extend(node.children[name] for name in sorted(node.children, reverse=True))

    # ---- reading ---------------------------------------------------------------------------------
    def _dtype_names(self, node: Node) -> tuple[str, str | None]:
        """(torch dtype name to return, name of the bits dtype the file stores it as, or None) of an array."""
        name = self._attrs(node).get(S.ATTR_TORCH_DTYPE)
        if name is not None and not self.is_legacy:
            pair = bits_dtype_names(str(name))
            if pair is None or numpy_dtype_name(node.dtype) != pair[1]:
                raise CheckpointFormatError(f"{self.path}: '{node.h5path}' has unknown {S.ATTR_TORCH_DTYPE}={name!r}")
            return pair
        dtype = None if node.dtype is None else numpy_dtype_name(node.dtype)
        if dtype is None:
            raise CheckpointFormatError(f"{self.path}: '{node.h5path}' has unsupported dtype {node.dtype}")
        return dtype, None

    def _torch_dtype(self, node: Node) -> tuple[torch.dtype, torch.dtype | None]:
        """(dtype to return, bits dtype the file stores it as or None) for an array dataset."""
        name, bits = self._dtype_names(node)
        if not hasattr(torch, name):
            raise CheckpointFormatError(f"{self.path}: '{node.h5path}' holds {name}, which this torch does not have")
        return getattr(torch, name), None if bits is None else getattr(torch, bits)

    def _read_array(self, node: Node, checks: _Checksums, out: torch.Tensor | None = None) -> torch.Tensor | np.ndarray:
        if node.shape is None:
            raise CheckpointCorruptError(f"{self.path}: '{node.h5path}' holds no data but should hold an array")
        name, bits_name = self._dtype_names(node)
        if out is None and (self._as_numpy == "raw" or (self._as_numpy and bits_name is None)):
            array = result = np.empty(node.shape, dtype=np.dtype(bits_name or name))  # "raw": bits, for checksums
        else:
            dtype, bits = self._torch_dtype(node)
            result = out = torch.empty(node.shape, dtype=dtype) if out is None else out
            target = out.detach().view(bits) if bits is not None else out.detach()
            array = target.numpy()
        with h5_guard(str(self.path), node.h5path):
            if array.size:
                node.dataset.read(h5s.ALL, h5s.ALL, array)
        checks.add(node, array)
        return result

    def _read_value(self, node: Node, checks: _Checksums) -> Any:
        if self.is_legacy:
            return self._read_legacy(node, checks)
        py_type = self._attrs(node).get(S.ATTR_PY_TYPE)
        if py_type not in S.PY_TYPES:
            raise CheckpointCorruptError(f"{self.path}: '{node.h5path}' has no valid {S.ATTR_PY_TYPE} attribute")
        if py_type in _ARRAY_TYPES:
            return self._read_array(node, checks)
        with h5_guard(str(self.path), node.h5path):
            data: Any = None
            if py_type != S.PY_NONE:
                ds = h5py.Dataset(node.dataset)
                data = ds.asstr()[()] if node.dtype.kind == "O" else ds[()]
                data = data.tolist() if isinstance(data, np.ndarray) and data.dtype.kind == "O" else data
            checks.add(node, data)
        try:
            return decode_python_value(py_type, data)
        except (ValueError, TypeError) as exc:
            message = f"{self.path}: '{node.h5path}' does not hold a valid {py_type}: {exc}"
            raise CheckpointCorruptError(message) from exc

    def _read_legacy(self, node: Node, checks: _Checksums) -> Any:
        if node.shape is None:
            return None
        if node.dtype.kind in "OSU":
            with h5_guard(str(self.path), node.h5path):
                data = h5py.Dataset(node.dataset)[()]
            return _legacy_str(data)
        if node.shape == ():
            with h5_guard(str(self.path), node.h5path):
                return h5py.Dataset(node.dataset)[()].item()
        return self._read_array(node, checks)

    def _read_tree(self, node: Node, checks: _Checksums) -> Any:
        if not node.is_group:
            return self._read_value(node, checks)
        return {name: self._read_tree(child, checks) for name, child in node.children.items()}

    def _new_checks(self) -> _Checksums:
        """Checks for one read: none when checksums are off or :meth:`verify` already checked every dataset.

        Saves replace a checkpoint by renaming, never in place, so what a full ``verify()`` checked is
        what the reads that follow get, and checksumming it again would only cost a second pass over
        the data. Should the file have been modified in place since (a ``cp`` over it: its size or
        modification time changed), reads check their checksums again.
        """
        on = self.verify_checksums and (self._verified_stat is None or self._verified_stat != self._stat())
        return _Checksums(str(self.path), self.checksum if on else None)

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def read(self, key: Key = None, *, as_numpy: bool = False) -> Any:
        """Read the value (or nested dict) at ``key``, verifying checksums of everything read.

        Arrays load as CPU tensors; with ``as_numpy=True`` as numpy arrays (except dtypes numpy lacks,
        such as bfloat16, which stay tensors), so a reader that wants numpy never needs torch.
        """
        checks = self._new_checks()
        self._as_numpy = as_numpy
        try:
            value = self._read_tree(self._node(key), checks)
        finally:
            self._as_numpy = False
            if checks.pool is not None:
                checks.pool.shutdown(wait=True)
        checks.finish()
        return value

    def read_into(self, key: Key, out: torch.Tensor) -> torch.Tensor:
        """Read the array at ``key`` straight into ``out`` (contiguous CPU tensor of the same shape and dtype).

        No intermediate copy is made. The checksum is verified after the read: on
        CheckpointCorruptError ``out`` holds undefined data, so call :meth:`verify` first when ``out``
        is live state.
        """
        node = self._node(key)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        info = self._info(node) if not node.is_group else None
        if info is None or not info.is_array:
            raise ValueError(f"{self.path}: '{node.keypath}' is not array data and cannot be read into a tensor")
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous CPU tensor, got device {out.device}, contiguous={out.is_contiguous()}"
            )
        if tuple(out.shape) != info.shape or out.dtype != info.dtype:
            raise ValueError(
                f"{self.path}: cannot read '{node.keypath}' into tensor: stored shape {info.shape} dtype {info.dtype}, "
                f"got shape {tuple(out.shape)} dtype {out.dtype}"
            )
        checks = self._new_checks()
        self._read_array(node, checks, out)
        checks.finish()
        return out

    def verify(self, key: Key = None) -> int:
        """Check the checksum of every dataset under ``key``, streaming large ones in 16 MiB pieces.

        Returns how many datasets were checked (0 for a legacy file, which has no checksums).
        Raises CheckpointCorruptError listing every damaged dataset.
        """
        if self.is_legacy:
            return 0
        before = self._stat()
        checks, count = _Checksums(str(self.path), self.checksum), 0
        stack = [self._node(key)]
        while stack:
            node = stack.pop()
            if node.is_group:
                stack.extend(node.children.values())
                continue
            count += 1
            if self._attrs(node).get(S.ATTR_PY_TYPE) not in _ARRAY_TYPES or node.shape in (None, ()):
                self._as_numpy = "raw"  # only the checksum matters: no tensor (no torch) needed
                try:
                    self._read_value(node, checks)
                finally:
                    self._as_numpy = False
                continue
            with h5_guard(str(self.path), node.h5path):
                crc = streamed_checksum(h5py.Dataset(node.dataset), self.checksum, _VERIFY_CHUNK_BYTES)
                checks.pending.append((node, crc))
        checks.finish()
        if key is None or self._node(key) is self._root:
            # the file as it was when this verify began, and only if it did not change while it ran
            self._verified_stat = before if before is not None and before == self._stat() else None
        return count


def _legacy_str(data: Any) -> Any:
    """Legacy h5py returns strings as bytes: decode utf-8 (keep bytes if not valid utf-8)."""
    if isinstance(data, np.ndarray):
        return [_legacy_str(item) for item in data.tolist()]
    if isinstance(data, bytes):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data
    return data


def open_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> CheckpointReader:
    """Open a checkpoint for inspection and partial reads (use it as a context manager)."""
    return CheckpointReader(path, verify=verify)


def load(path: str | os.PathLike[str], key: Key = None, *, verify: bool = True) -> Any:
    """Load a whole checkpoint, or only the subtree at ``key``, as a nested dict.

    ``key`` is a '/'-separated path of the original key names (or a tuple of names, for keys that
    contain '/'); only that subtree's datasets are read. Array data comes back as CPU
    ``torch.Tensor`` (the library is torch-first; numpy arrays saved come back as tensors too);
    python scalars, str, bytes, None, lists and tuples come back as themselves. With ``verify``
    every dataset read is checked against its checksum and the structure against the root digest.
    """
    with CheckpointReader(path, verify=verify) as reader:
        return reader.read(key)
