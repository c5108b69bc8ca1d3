"""What a dataset may be before anything is read from it: bounded by the file, typed as our writer types.

Two kinds of checks, both against crafted files (which may carry valid checksums):

* :class:`StorageCheck`, while the file is scanned: no filter at all (a compressed dataset can declare
  terabytes in a few kilobytes), no external or virtual storage, only the HDF5 types our writer and the
  legacy ORTTrainer wrote, every dimension within the file's size, and every byte a read would
  produce really stored in the file: the storage HDF5 allocated (contiguous, compact or chunked)
  covers the declared shape (an unwritten dataset would read as fill values), the strings of a
  variable-length string dataset add up to no more than the file, and all datasets together claim
  no more than the file's size (storage shared between datasets would multiply it).
* :func:`check_attrs`, when a dataset's attributes are first read: ``py_type``, ``torch_dtype`` and the
  checksum attribute agree with the stored dtype and shape, so that every reader (load, verify,
  aggregation, the CLI, the trainer) calls the same datasets corrupt.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, BinaryIO

import h5py
import numpy as np
from h5py import h5d, h5s, h5z

from ..errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError
from . import schema as S
from ._codec import bits_dtype_names, numpy_dtype_name

__all__ = ["StorageCheck", "check_attrs"]

_FILTER_NAMES = {
    h5z.FILTER_DEFLATE: "gzip",
    h5z.FILTER_SHUFFLE: "shuffle",
    h5z.FILTER_FLETCHER32: "fletcher32",
    h5z.FILTER_SZIP: "szip",
    h5z.FILTER_NBIT: "nbit",
    h5z.FILTER_SCALEOFFSET: "scaleoffset",
    32000: "lzf",
}
_LAYOUTS = {h5d.CONTIGUOUS: "contiguous", h5d.COMPACT: "compact", h5d.CHUNKED: "chunked"}
_NUMERIC_KINDS = "biufc"
_VLEN_RECORD_SIZES = (12, 16)  # on disk: u32 length, heap address (4 or 8 bytes), u32 index


def _type_problem(dtype: np.dtype) -> str | None:
    """Why HDF5 data of this numpy dtype is not checkpoint data (None if it is)."""
    if dtype.fields is not None or dtype.subdtype is not None:
        return "a compound or array type"
    if dtype.kind in _NUMERIC_KINDS or dtype.kind == "S":
        return None
    if dtype.kind == "O" and h5py.check_string_dtype(dtype) is not None:
        return None
    return "an opaque, reference or variable-length sequence type" if dtype.kind in "VO" else f"kind {dtype.kind!r}"


@dataclass
class StorageCheck:
    """Per-file state of the scan-time checks: the file (for messages and string lengths) and the budget.

    ``fd`` is the descriptor HDF5 reads the file through: string records are read from that very file,
    never from the name again (a manager may prune the name, or a save replace it, once it is open).
    """

    filename: str
    file_size: int
    fd: int | None = None
    raw: BinaryIO | None = None  # without ``fd``: opened by name on the first variable-length string dataset
    claimed: int = 0  # bytes the datasets checked so far can produce, in all

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()

    def _read_at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` of the open file (fewer only at its end)."""
        if self.fd is not None:
            pieces, done = [], 0
            while done < size:
                piece = os.pread(self.fd, size - done, offset + done)
                if not piece:
                    break
                pieces.append(piece)
                done += len(piece)
            return b"".join(pieces)
        if self.raw is None:
            try:
                self.raw = open(self.filename, "rb")  # closed by close()
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"{self.filename}: the checkpoint was removed while it was being read"
                ) from None
        self.raw.seek(offset)
        return self.raw.read(size)

    def dataset(self, dsid: h5d.DatasetID, h5path: str) -> tuple[tuple[int, ...] | None, np.dtype]:
        """Refuse or bound one dataset; return (shape or None for an empty dataspace, dtype)."""
        where = f"{self.filename}: dataset '{h5path}'"
        dcpl = dsid.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5d.VIRTUAL:
            raise CheckpointFormatError(f"{self.filename}: refusing virtual dataset '{h5path}' (it reads other files)")
        if dcpl.get_external_count():
            files = [dcpl.get_external(i)[0].decode("utf-8", "replace") for i in range(dcpl.get_external_count())]
            raise CheckpointFormatError(f"{self.filename}: refusing dataset '{h5path}' with external storage {files}")
        if dcpl.get_nfilters():
            names = [_FILTER_NAMES.get(code, f"plugin filter {code}") for code in _filter_codes(dcpl)]
            raise CheckpointFormatError(
                f"{self.filename}: refusing dataset '{h5path}' with HDF5 filter(s) {names}: checkpoint data is "
                "stored unfiltered (FORMAT.md); rewrite the file without filters, e.g. `h5repack -f NONE`"
            )
        dtype = dsid.dtype
        if (problem := _type_problem(dtype)) is not None:
            raise CheckpointFormatError(f"{where} has unsupported HDF5 type {dtype} ({problem})")
        space = dsid.get_space()
        if space.get_simple_extent_type() == h5s.NULL:
            return None, dtype
        shape = space.shape
        if any(dim > self.file_size for dim in shape):
            raise CheckpointCorruptError(
                f"{where} has shape {shape}, a dimension larger than the file's {self.file_size} bytes"
            )
        self._storage(dsid, h5path, where, layout, math.prod(shape), dtype)
        return shape, dtype

    def _storage(self, dsid: h5d.DatasetID, h5path: str, where: str, layout: int, count: int, dtype: np.dtype) -> None:
        strings = dtype.kind == "O"
        need = count * (min(_VLEN_RECORD_SIZES) if strings else dtype.itemsize)
        if need > self.file_size:
            raise CheckpointCorruptError(f"{where} claims {need} bytes but the file has only {self.file_size}")
        stored = dsid.get_storage_size() if count else 0
        if stored < need:
            raise CheckpointCorruptError(
                f"{where} declares {need} bytes of data but stores only {stored} (never or only partly written)"
            )
        if stored > self.file_size:
            raise CheckpointCorruptError(
                f"{where} claims {stored} bytes of storage but the file has only {self.file_size}"
            )
        self.claimed += stored
        if strings and count:
            if layout != h5d.CONTIGUOUS:
                raise CheckpointFormatError(
                    f"{where}: variable-length strings with {_LAYOUTS.get(layout, layout)} layout are not supported "
                    "(checkpoint strings are contiguous)"
                )
            self.claimed += self._string_bytes(dsid, where, count, stored)
        if self.claimed > self.file_size:
            raise CheckpointCorruptError(
                f"{self.filename}: the datasets up to '{h5path}' claim {self.claimed} bytes in all but the file has "
                f"only {self.file_size} (storage shared between datasets, or string lengths beyond the data)"
            )

    def _string_bytes(self, dsid: h5d.DatasetID, where: str, count: int, stored: int) -> int:
        """Total length of a variable-length string dataset's strings, read from its stored records."""
        record, rest = divmod(stored, count)
        offset = dsid.get_offset()
        if rest or record not in _VLEN_RECORD_SIZES or offset is None or offset + stored > self.file_size:
            raise CheckpointCorruptError(f"{where}: {stored} bytes of string records for {count} strings")
        records = np.frombuffer(self._read_at(offset, stored), dtype=np.uint8)
        if records.size != stored:
            raise CheckpointCorruptError(f"{where}: string records end past the end of the file")
        lengths = records.reshape(count, record)[:, :4].copy().view("<u4")
        total = int(lengths.sum(dtype=np.int64))
        if total > self.file_size:
            raise CheckpointCorruptError(
                f"{where} holds strings of {total} bytes in all, more string bytes than the file's {self.file_size}"
            )
        return total


def _filter_codes(dcpl: Any) -> list[int]:
    return [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]


# ---- attributes ---------------------------------------------------------------------------------------
def _is_vector(shape: tuple[int, ...] | None) -> bool:
    return shape is not None and len(shape) == 1


def _fits(py_type: str, shape: tuple[int, ...] | None, dtype: np.dtype) -> bool:
    """Whether data of this shape and dtype can hold a value of this ``py_type`` as our writer stores it."""
    string = dtype.kind == "O"
    bytes_ = dtype == np.dtype(np.uint8) and _is_vector(shape)
    if py_type in (S.PY_TENSOR, S.PY_NDARRAY):
        return shape is not None and numpy_dtype_name(dtype) is not None
    if py_type == S.PY_NUMPY_SCALAR:
        return shape == () and numpy_dtype_name(dtype) is not None
    if py_type in (S.PY_INT, S.PY_FLOAT, S.PY_BOOL):
        expected = {S.PY_INT: np.int64, S.PY_FLOAT: np.float64, S.PY_BOOL: np.bool_}[py_type]
        return shape == () and dtype.newbyteorder("=") == np.dtype(expected)
    if py_type == S.PY_STR:
        return (shape == () and string) or bytes_
    if py_type == S.PY_BYTES:
        return bytes_
    if py_type == S.PY_NONE:
        return shape is None
    elements = (np.dtype(np.bool_), np.dtype(np.int64), np.dtype(np.float64))
    return _is_vector(shape) and (string or dtype.newbyteorder("=") in elements)  # list, tuple


def check_attrs(
    attrs: dict[str, Any], shape: tuple[int, ...] | None, dtype: np.dtype, where: str, checksum: str
) -> None:
    """Raise CheckpointCorruptError unless our attributes describe this dataset's stored data."""
    py_type = attrs.get(S.ATTR_PY_TYPE)
    if py_type not in S.PY_TYPES:
        raise CheckpointCorruptError(f"{where} has no valid {S.ATTR_PY_TYPE} attribute (found {py_type!r})")
    if not _fits(py_type, shape, dtype):
        raise CheckpointCorruptError(
            f"{where} has {S.ATTR_PY_TYPE}={py_type!r}, which its data cannot hold (dtype {dtype}, shape {shape})"
        )
    name = attrs.get(S.ATTR_TORCH_DTYPE)
    if name is not None:
        pair = bits_dtype_names(str(name)) if isinstance(name, str) else None
        if py_type != S.PY_TENSOR or pair is None or numpy_dtype_name(dtype) != pair[1]:
            raise CheckpointFormatError(f"{where} has unknown {S.ATTR_TORCH_DTYPE}={name!r} for {dtype} data")
    crc = attrs.get(checksum)
    if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc <= 0xFFFFFFFF:
        raise CheckpointCorruptError(f"{where} has no valid {checksum} attribute (found {crc!r})")
