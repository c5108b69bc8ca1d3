"""``state.safetensors``: every state tensor of a training artifact, and its update count.

Written and read with the ``safetensors`` package (its numpy API: no torch needed by a reader, no code run from
the file). Before any tensor is read, the header is checked here against the file's size and, where a manifest
says what the file must hold, against the manifest's names, dtypes and shapes: a bad file is refused by name
(`ArtifactError`), never with the library's own error or after a large allocation.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import ArtifactError

__all__ = ["FORMAT", "read_header", "read_state", "write_state"]

FORMAT = "ort_trainer.training_artifact"
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32", "I16": "int16",
    "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
_CODES = {v: k for k, v in _DTYPES.items()}


def _safetensors_numpy() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "training artifacts store their state in safetensors files, which needs the 'safetensors' package: "
            'pip install safetensors (or pip install "ort_trainer[safetensors]")'
        ) from None
    return safetensors.numpy


def write_state(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], step: int) -> None:
    """Write ``tensors`` (numpy arrays, in order) with ``{"format": FORMAT, "step": str(step)}`` metadata."""
    unknown = sorted(f"{k} ({v.dtype})" for k, v in tensors.items() if str(v.dtype) not in _CODES)
    if unknown:
        raise ArtifactError(f"state tensors of dtypes a training artifact cannot hold: {unknown}")
    data = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    _safetensors_numpy().save_file(data, str(path), metadata={"format": FORMAT, "step": str(int(step))})


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], int]:
    """``({name: {"dtype": numpy dtype name, "shape": [...]}}, step)`` from the header of ``path``, checked: the
    header's size and every tensor's byte range within the file, dtypes known, sizes equal to shape x dtype,
    ``__metadata__`` of a training artifact with an integer step >= 0."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(8)
            if len(head) < 8:
                raise ArtifactError(f"{path}: {size} bytes, too short for a safetensors file (8-byte header size)")
            (length,) = struct.unpack("<Q", head)
            if length > min(_HEADER_LIMIT, size - 8):
                raise ArtifactError(
                    f"{path}: its header claims {length:,} bytes, but the file has {size - 8:,} bytes after the "
                    "size field (truncated or not a safetensors file)"
                )
            text = file.read(length)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such state file") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(f"{path}: its safetensors header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: its safetensors header is a {type(header).__name__}, expected an object")
    metadata = header.pop("__metadata__", None)
    step = _step(path, metadata)
    data_size = size - 8 - length
    found: dict[str, dict[str, Any]] = {}
    for name, entry in header.items():
        found[name] = _entry(path, name, entry, data_size)
    return found, step


def _step(path: Path, metadata: Any) -> int:
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise ArtifactError(
            f"{path}: __metadata__ {metadata!r} is not a training artifact's (expected "
            f'{{"format": "{FORMAT}", "step": "<int>"}})'
        )
    text = metadata.get("step")
    if not isinstance(text, str) or not text.isdigit():
        raise ArtifactError(f"{path}: __metadata__ step {text!r} is not a non-negative integer written as a string")
    return int(text)


def _entry(path: Path, name: str, entry: Any, data_size: int) -> dict[str, Any]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ArtifactError(f"{where}: header entry {entry!r} lacks dtype, shape or data_offsets")
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ArtifactError(f"{where}: dtype {entry['dtype']!r} is not one of {sorted(_DTYPES)}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ArtifactError(f"{where}: shape {shape!r} is not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ArtifactError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if not 0 <= begin <= end <= data_size or end - begin != expected:
        raise ArtifactError(
            f"{where}: bytes [{begin}, {end}) do not hold {dtype} {shape} ({expected:,} bytes) within the file's "
            f"{data_size:,} bytes of data (truncated or corrupt)"
        )
    return {"dtype": dtype, "shape": list(shape)}


def read_state(
    path: str | os.PathLike, expected: Mapping[str, Mapping[str, Any]] | None = None
) -> tuple[dict[str, np.ndarray], int]:
    """(tensors, step) of ``path``; with ``expected`` (``{name: {"dtype", "shape"}}``, the manifest's concrete
    shapes), every name present with that dtype and shape, and no other, checked before reading."""
    header, step = read_header(path)
    if expected is not None:
        missing = [n for n in expected if n not in header]
        extra = [n for n in header if n not in expected]
        if missing or extra:
            raise ArtifactError(
                f"{path}: the state tensors differ from the manifest's: missing {missing[:10]}, unexpected {extra[:10]}"
            )
        for name, want in expected.items():
            got = header[name]
            if got["dtype"] != want["dtype"] or list(got["shape"]) != list(want["shape"]):
                raise ArtifactError(
                    f"{path}: tensor {name!r} is {got['dtype']} {got['shape']}, the manifest expects "
                    f"{want['dtype']} {list(want['shape'])}"
                )
    try:
        tensors = _safetensors_numpy().load_file(str(path))
    except Exception as error:  # noqa: BLE001 - the library's errors, told with the file's name
        raise ArtifactError(f"{path}: not a readable safetensors file ({type(error).__name__}: {error})") from None
    order = list(expected) if expected is not None else list(header)
    return {name: tensors[name] for name in order}, step
