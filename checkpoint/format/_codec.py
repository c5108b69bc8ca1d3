"""How one value maps to one HDF5 dataset and back; key escaping (checksums: ``_checksum``).

Shared by the writer and the reader so both sides agree on every marker. Array payloads are
never copied here: a CPU tensor becomes a zero-copy numpy view at write time.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from . import schema as S
from .lazy_torch import is_tensor, torch

__all__ = [
    "BITS_DTYPE_NAMES",
    "STR_DTYPE",
    "Leaf",
    "bits_dtype",
    "bits_dtype_names",
    "decode_python_value",
    "encode_leaf",
    "escape_key",
    "leaf_array",
    "numpy_dtype_name",
    "numpy_to_torch_dtype",
    "unescape_key",
]

STR_DTYPE = h5py.string_dtype("utf-8")

# torch dtypes numpy cannot represent: stored as unsigned integers of the same width (the bits),
# with ATTR_TORCH_DTYPE naming the real dtype. The name list doubles as the allow-list on read.
BITS_DTYPE_NAMES = {
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
}
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: the numpy kinds we store
# numpy dtypes we store and the torch dtype of the same name (numpy's bool_ is torch's bool)
_STORED_NUMPY = tuple(
    np.dtype(t)
    for t in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64)
    + (np.float16, np.float32, np.float64, np.complex64, np.complex128)
)


@functools.cache
def _bits_dtypes() -> dict[str, tuple[torch.dtype, torch.dtype]]:
    """{name: (real torch dtype, torch dtype of its bits)} for the dtypes this torch has (imports torch)."""
    return {
        name: (getattr(torch, name), getattr(torch, bits))
        for name, bits in BITS_DTYPE_NAMES.items()
        if hasattr(torch, name)
    }


@functools.cache
def _bits_by_dtype() -> dict[torch.dtype, tuple[str, torch.dtype]]:
    return {real: (name, bits) for name, (real, bits) in _bits_dtypes().items()}


@functools.cache
def _torch_by_numpy() -> dict[np.dtype, torch.dtype]:
    return {d: getattr(torch, d.name) for d in _STORED_NUMPY}


def numpy_dtype_name(dtype: np.dtype) -> str | None:
    """The torch-style name of a stored numpy dtype ('float32', 'bool'), None for kinds we do not store."""
    dtype = dtype.newbyteorder("=")
    if dtype.kind not in _NUMPY_KINDS or dtype not in _STORED_NUMPY:
        return None
    return dtype.name


def bits_dtype_names(torch_dtype_name: str) -> tuple[str, str] | None:
    """(real dtype name, bits dtype name) for a dtype stored as its bits, without importing torch."""
    bits = BITS_DTYPE_NAMES.get(torch_dtype_name)
    return None if bits is None else (torch_dtype_name, bits)


def escape_key(key: str) -> str:
    """Percent-encode the characters HDF5 cannot hold in a name: '%', '/', NUL (and the name '.')."""
    if key == ".":
        return "%2E"
    return key.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")


_UNESCAPE = {"%25": "%", "%2F": "/", "%00": "\x00", "%2E": "."}
_UNESCAPE_RE = re.compile("%25|%2F|%00|%2E")


def unescape_key(name: str) -> str:
    """Inverse of :func:`escape_key` (only for files in our format; legacy names are verbatim)."""
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPE[m.group(0)], name) if "%" in name else name


@dataclass(frozen=True)
class Leaf:
    """One value ready to be written: the payload (tensor, array, str or Empty) and its attributes."""

    data: Any
    attrs: dict[str, str]


def _check_numpy_dtype(dtype: np.dtype, keypath: str) -> None:
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise TypeError(f"unsupported numpy dtype {dtype} at '{keypath}': only bool, integer, float and complex")


def _encode_tensor(value: torch.Tensor, keypath: str) -> Leaf:
    if value.is_sparse or value.is_quantized or value.layout != torch.strided:
        raise TypeError(f"unsupported tensor at '{keypath}': only dense strided tensors ({value.layout})")
    attrs = {S.ATTR_PY_TYPE: S.PY_TENSOR}
    if value.dtype in _bits_by_dtype():
        attrs[S.ATTR_TORCH_DTYPE] = _bits_by_dtype()[value.dtype][0]
    elif value.dtype not in _torch_by_numpy().values():
        raise TypeError(f"unsupported tensor dtype {value.dtype} at '{keypath}'")
    return Leaf(value, attrs)


def _encode_sequence(value: list | tuple, keypath: str) -> Leaf:
    py_type = S.PY_LIST if isinstance(value, list) else S.PY_TUPLE
    kinds = {type(v) for v in value}
    if not value:
        data: Any = np.zeros((0,), dtype=np.float64)
    elif kinds == {bool}:
        data = np.array(value, dtype=np.bool_)
    elif kinds == {int}:
        data = _int64_array(value, keypath)
    elif kinds == {float}:
        data = np.array(value, dtype=np.float64)
    elif kinds == {str}:
        data = [_check_str(v, keypath) for v in value]
    else:
        names = sorted(k.__name__ for k in kinds)
        raise TypeError(
            f"unsupported {py_type} at '{keypath}' with element types {names}: a list or tuple must hold "
            "elements of one type among bool, int, float, str (store other content as a dict or tensor)"
        )
    return Leaf(data, {S.ATTR_PY_TYPE: py_type})


def _int64_array(value: Any, keypath: str) -> np.ndarray:
    try:
        return np.array(value, dtype=np.int64)
    except OverflowError:
        raise TypeError(f"integer out of int64 range at '{keypath}': {value!r}") from None


def _check_str(value: str, keypath: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TypeError(f"string at '{keypath}' is not valid unicode: {exc}") from None
    return value


def encode_leaf(value: Any, keypath: str) -> Leaf:
    """Map a leaf value to its stored form; TypeError naming ``keypath`` for anything unsupported."""
    if is_tensor(value):
        return _encode_tensor(value, keypath)
    if isinstance(value, np.ndarray | np.generic):
        _check_numpy_dtype(value.dtype, keypath)
        py_type = S.PY_NDARRAY if isinstance(value, np.ndarray) else S.PY_NUMPY_SCALAR
        return Leaf(np.asarray(value), {S.ATTR_PY_TYPE: py_type})
    if isinstance(value, bool):
        return Leaf(np.array(value, dtype=np.bool_), {S.ATTR_PY_TYPE: S.PY_BOOL})
    if isinstance(value, int):
        return Leaf(_int64_array(value, keypath), {S.ATTR_PY_TYPE: S.PY_INT})
    if isinstance(value, float):
        return Leaf(np.array(value, dtype=np.float64), {S.ATTR_PY_TYPE: S.PY_FLOAT})
    if isinstance(value, str):
        # HDF5 strings end at NUL: such strings are stored as their utf-8 bytes instead.
        data = _check_str(value, keypath)
        return Leaf(np.frombuffer(data.encode(), np.uint8) if "\x00" in data else data, {S.ATTR_PY_TYPE: S.PY_STR})
    if isinstance(value, bytes):
        return Leaf(np.frombuffer(value, dtype=np.uint8), {S.ATTR_PY_TYPE: S.PY_BYTES})
    if value is None:
        return Leaf(h5py.Empty("f"), {S.ATTR_PY_TYPE: S.PY_NONE})
    if isinstance(value, list | tuple):
        return _encode_sequence(value, keypath)
    raise TypeError(
        f"unsupported value of type {type(value).__module__}.{type(value).__qualname__} at '{keypath}': "
        "supported are dicts, torch tensors, numpy arrays/scalars, int, float, bool, str, bytes, None "
        "and lists/tuples of one scalar type"
    )


def leaf_array(leaf: Leaf) -> Any:
    """The payload as h5py writes it: tensors become zero-copy numpy views (bits for bfloat16)."""
    data = leaf.data
    if is_tensor(data):
        data = data.detach()
        if data.device.type != "cpu":
            data = data.cpu()  # one tensor at a time: the extra memory is bounded by the largest tensor
        data = data.resolve_conj().resolve_neg().contiguous()
        if data.dtype in _bits_by_dtype():
            data = data.view(_bits_by_dtype()[data.dtype][1])
        return data.numpy()
    if isinstance(data, np.ndarray) and (not data.dtype.isnative or not data.flags.c_contiguous):
        return np.asarray(data, dtype=data.dtype.newbyteorder("="), order="C")  # keeps 0-d arrays 0-d
    return data


def bits_dtype(torch_dtype_name: str) -> tuple[torch.dtype, torch.dtype] | None:
    """(real dtype, stored bits dtype) for an allow-listed ATTR_TORCH_DTYPE value, else None."""
    return _bits_dtypes().get(torch_dtype_name)


def numpy_to_torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype for a stored numeric numpy dtype (any byte order), or None if unsupported."""
    return _torch_by_numpy().get(dtype.newbyteorder("=")) if dtype.kind in _NUMPY_KINDS else None


def decode_python_value(py_type: str, data: Any) -> Any:
    """Rebuild a python value (int/float/bool/str/bytes/None/list/tuple) from what was read."""
    if py_type == S.PY_NONE:
        return None
    if py_type == S.PY_STR:
        return bytes(data).decode("utf-8") if isinstance(data, np.ndarray) else str(data)
    if py_type == S.PY_BYTES:
        return np.asarray(data, dtype=np.uint8).tobytes()
    if py_type in (S.PY_INT, S.PY_FLOAT, S.PY_BOOL):
        value = np.asarray(data).reshape(()).item()
        kind = {S.PY_INT: int, S.PY_FLOAT: float, S.PY_BOOL: bool}[py_type]
        if type(value) is not kind:
            raise ValueError(f"stored {py_type} has dtype {np.asarray(data).dtype}")
        return value
    items = list(data) if isinstance(data, list) else np.asarray(data).tolist()
    return items if py_type == S.PY_LIST else tuple(items)
