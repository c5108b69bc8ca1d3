"""Helpers shared by the ``ort-trainer-ckpt`` subcommands: exit codes, input kinds, JSON values, atomic output.

Pure helpers (``dtype_name``, ``value_nbytes``, ``jsonable``, ``key_str``) take no paths; the few
that touch files (``input_kind``, ``check_output``, ``write_atomically``) are at the bottom.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np

from ..errors import CheckpointExistsError, CheckpointFormatError, CheckpointNotFoundError
from ..format import DatasetInfo
from ..format.files import fsync_path, publish
from ..format.lazy_torch import is_tensor, is_torch_dtype, torch
from ..sets import is_manifest

__all__ = [
    "ALL_KINDS",
    "EXIT_ERROR",
    "EXIT_FOUND",
    "EXIT_OK",
    "OUR_KINDS",
    "PROG",
    "InputKind",
    "check_output",
    "dtype_name",
    "input_kind",
    "jsonable",
    "key_str",
    "output_kind",
    "value_nbytes",
    "write_atomically",
]

InputKind = Literal["manifest", "checkpoint", "torch", "safetensors"]
ALL_KINDS: tuple[InputKind, ...] = ("checkpoint", "manifest", "torch", "safetensors")
OUR_KINDS: tuple[InputKind, ...] = ("checkpoint", "manifest")  # what inspect and verify read
PROG = "ort-trainer-ckpt"
EXIT_OK, EXIT_FOUND, EXIT_ERROR = 0, 1, 2  # ok; differences or damage found; error
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
_SCALAR_NBYTES = {int: 8, float: 8, bool: 1, type(None): 0}
_INLINE_NUMEL = 8  # tensors up to this many elements are shown by value in JSON


# ---- pure helpers -----------------------------------------------------------------------------------
def key_str(key: tuple[str, ...]) -> str:
    """('model', 'full_precision', 'w') -> 'model/full_precision/w'."""
    return "/".join(key)


def dtype_name(dtype: torch.dtype | np.dtype | type) -> str:
    """'float32' for torch.float32 (and numpy's float32), 'int' for int, 'NoneType' for None."""
    if is_torch_dtype(dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, np.dtype):
        return dtype.name
    return dtype.__name__


def value_nbytes(info: DatasetInfo) -> int | None:
    """Bytes of array data (numel * itemsize) and of numeric scalars; None for str/bytes/lists (unknown unread)."""
    if info.is_array:
        return info.nbytes
    size = _SCALAR_NBYTES.get(info.dtype)
    return None if size is None else size * math.prod(info.shape)


def jsonable(value: Any) -> Any:
    """A JSON-safe copy: small tensors/arrays as lists, large ones as a description, bytes by length."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray | np.generic) or is_tensor(value):
        complex_ = value.is_complex() if is_tensor(value) else np.iscomplexobj(value)
        if math.prod(value.shape) <= _INLINE_NUMEL and not complex_:
            return jsonable(value.tolist())
        return f"<tensor shape {list(value.shape)} {dtype_name(value.dtype)}>"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def output_kind(path: Path) -> Literal["checkpoint", "torch", "safetensors"]:
    """By suffix: .pt/.pth/.bin -> torch, .safetensors -> safetensors, anything else -> our checkpoint."""
    suffix = path.suffix.lower()
    if suffix in TORCH_SUFFIXES:
        return "torch"
    return "safetensors" if suffix == SAFETENSORS_SUFFIX else "checkpoint"


# ---- file helpers -----------------------------------------------------------------------------------
def input_kind(path: Path, reads: tuple[InputKind, ...] = ALL_KINDS) -> InputKind:
    """What ``path`` holds, by content where possible (HDF5 signature, manifest JSON), else by suffix.

    ``reads``: the kinds the command reads, named in the error for a file that is none of the known kinds.
    """
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointFormatError(f"{path} is a directory; give a checkpoint, manifest, .pt or .safetensors file")
    if not path.is_file():
        raise CheckpointFormatError(f"{path} is not a regular file (a FIFO, socket or device)")
    if path.suffix.lower() == SAFETENSORS_SUFFIX:
        return "safetensors"
    if h5py.is_hdf5(path):
        return "checkpoint"
    if is_manifest(path):
        return "manifest"
    with open(path, "rb") as fh:
        zipped = fh.read(4) == b"PK\x03\x04"  # torch.save's zip container
    if zipped or path.suffix.lower() in TORCH_SUFFIXES:
        return "torch"
    named = [_KIND_NAMES[kind] for kind in reads]
    either = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
    raise CheckpointFormatError(f"{path} is not {either}")


_KIND_NAMES = {
    "checkpoint": "a checkpoint (HDF5)",
    "manifest": "a manifest (.manifest.json)",
    "torch": f"a PyTorch file ({', '.join(TORCH_SUFFIXES)})",
    "safetensors": f"a {SAFETENSORS_SUFFIX} file",
}


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse early (before any work) an output that exists without --overwrite, or whose folder is missing."""
    if path.is_dir():
        raise CheckpointFormatError(f"{path} is a directory; give a file path for the output")
    if path.exists() and not overwrite:
        raise CheckpointExistsError(f"{path} already exists; pass --overwrite to replace it")
    if not path.parent.is_dir():
        raise CheckpointNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")


def write_atomically(path: Path, write: Callable[[Path], None], *, overwrite: bool) -> None:
    """Call ``write(tmp)`` on a temp file next to ``path``, fsync it, then publish it under ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        fsync_path(tmp, os.O_RDONLY)
        publish(tmp, path, overwrite)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
