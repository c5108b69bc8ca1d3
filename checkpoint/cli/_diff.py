"""``ort-trainer-ckpt diff``: compare two checkpoints key by key, one tensor in memory at a time.

Keys are '/'-joined paths. Shapes and dtypes are compared from metadata first; tensor values are
read only when those agree. Within tolerance means ``|a - b| <= atol + rtol * |b|`` elementwise
(NaN equals NaN at the same position). ``compare_*`` and ``format_diff`` are pure.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..format import DatasetInfo, open_checkpoint
from ..format.lazy_torch import is_tensor, torch
from ..sets import aggregate_checkpoints
from ._common import EXIT_FOUND, EXIT_OK, InputKind, dtype_name, input_kind, key_str
from ._convert import flatten, read_state_dict
from ._remote import path_or_url

__all__ = ["Difference", "add_command", "compare_tensors", "compare_values", "diff_paths", "format_diff"]

_CHUNK = 1 << 20  # elements compared at a time (bounds the float64 temporaries)
_REPR_CHARS = 60


@dataclass(frozen=True)
class Difference:
    """One finding: ``kind`` is 'only_a', 'only_b', 'layout' (type/shape/dtype), 'tensor' or 'value'."""

    kind: str
    key: str
    detail: str = ""
    max_abs: float = 0.0  # for 'tensor' (and numeric 'value'): the largest absolute difference


# ---- pure comparisons -----------------------------------------------------------------------------------
def _short(value: Any) -> str:
    text = f"<{len(value)} bytes>" if isinstance(value, bytes) else repr(value)
    return text if len(text) <= _REPR_CHARS else text[: _REPR_CHARS - 3] + "..."


def _chunk_stats(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> tuple[float, int, int]:
    """For 1-D chunks: (largest finite |a - b|, elements outside tolerance, elements NaN on one side only)."""
    wide = np.complex128 if np.iscomplexobj(a) else np.float64
    x, y = a.astype(wide), b.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        delta = np.where(same, 0.0, np.abs(x - y))
        one_nan = np.isnan(delta)
        bad = one_nan | (delta > atol + rtol * np.abs(y))
    worst = float(np.where(one_nan, 0.0, delta).max())
    return worst, int(bad.sum()), int(one_nan.sum())


def _as_numpy(value: Any) -> np.ndarray:
    """An array or tensor as a flat contiguous numpy array; dtypes numpy lacks (bfloat16, float8) as float64 (exact)."""
    if is_tensor(value):
        value = value.detach().cpu()
        if value.dtype in (torch.bfloat16,) or value.dtype.itemsize == 1 and value.dtype.is_floating_point:
            value = value.to(torch.float64)
        value = value.numpy()
    return np.ascontiguousarray(value).reshape(-1)


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or is_tensor(value)


def compare_tensors(key: str, a: Any, b: Any, atol: float, rtol: float) -> Difference | None:
    """None if equal within tolerance, else the largest absolute difference and how many elements differ.

    ``a`` and ``b`` are tensors or numpy arrays (the checkpoint tool reads our files as numpy: no torch).
    """
    if dtype_name(a.dtype) != dtype_name(b.dtype) or tuple(a.shape) != tuple(b.shape):
        return Difference(
            "layout", key, f"{tuple(a.shape)} {dtype_name(a.dtype)} vs {tuple(b.shape)} {dtype_name(b.dtype)}"
        )
    x, y = _as_numpy(a), _as_numpy(b)
    if x.size == 0 or np.array_equal(x.view(np.uint8), y.view(np.uint8)):
        return None
    worst, count, nans = 0.0, 0, 0
    for start in range(0, x.size, _CHUNK):
        stats = _chunk_stats(x[start : start + _CHUNK], y[start : start + _CHUNK], atol, rtol)
        worst, count, nans = max(worst, stats[0]), count + stats[1], nans + stats[2]
    if count == 0:
        return None
    nan_text = f", {nans} NaN on one side only" if nans else ""
    detail = f"max abs diff {worst:.6g} ({count} of {x.size} elements differ{nan_text})"
    return Difference("tensor", key, detail, math.inf if nans else worst)


def compare_values(key: str, a: Any, b: Any, atol: float, rtol: float) -> Difference | None:
    """Python values: numbers within tolerance (bools and ints of different type are not numbers alike)."""
    if _is_array(a) or _is_array(b):
        if _is_array(a) and _is_array(b):
            return compare_tensors(key, a, b, atol, rtol)
        return Difference("layout", key, f"{_kind(a)} vs {_kind(b)}")
    if type(a) is not type(b):
        return Difference("layout", key, f"{type(a).__name__} {_short(a)} vs {type(b).__name__} {_short(b)}")
    if isinstance(a, int | float) and not isinstance(a, bool):
        gap = abs(a - b)
        if a == b or (a != a and b != b) or gap <= atol + rtol * abs(b):
            return None
        return Difference("value", key, f"{_short(a)} vs {_short(b)}", gap if gap == gap else math.inf)
    return None if a == b else Difference("value", key, f"{_short(a)} vs {_short(b)}")


def _kind(value: Any) -> str:
    if _is_array(value):
        return f"tensor {tuple(value.shape)} {dtype_name(value.dtype)}"
    return type(value).__name__


def _layout(info: DatasetInfo) -> str:
    if info.is_array:
        return f"tensor {info.shape} {info.dtype_name}"
    return info.dtype_name


def format_diff(diffs: list[Difference], a: str, b: str, compared: int, atol: float, rtol: float) -> list[str]:
    """Only-in keys, layout differences, tensors by largest difference first, then values; and a summary."""
    order = {"only_a": 0, "only_b": 1, "layout": 2, "tensor": 3, "value": 4}
    ranked = sorted(diffs, key=lambda d: (order[d.kind], -d.max_abs if d.kind == "tensor" else 0.0, d.key))
    label = {"only_a": f"only in {a}", "only_b": f"only in {b}", "layout": "type/shape/dtype differs"}
    lines = []
    for d in ranked:
        head = label.get(d.kind, f"{d.kind} differs")
        lines.append(f"{head}: {d.key}" + (f": {d.detail}" if d.detail else ""))
    tolerance = "exactly" if atol == 0 and rtol == 0 else f"within atol={atol:g}, rtol={rtol:g}"
    if diffs:
        lines.append(f"{len(diffs)} difference(s) between {a} and {b} ({compared} keys compared {tolerance})")
    else:
        lines.append(f"{a} and {b} are equal ({compared} keys, {tolerance})")
    return lines


# ---- reading -------------------------------------------------------------------------------------------
class _Flat:
    """A checkpoint (read key by key) or an in-memory tree, as '/'-joined keys with metadata."""

    def __init__(self, infos: Mapping[str, Any], read: Any) -> None:
        self.infos, self.read = infos, read


def _info_of(value: Any) -> DatasetInfo:
    if is_tensor(value):
        return DatasetInfo(tuple(value.shape), value.dtype)
    return DatasetInfo((), type(value))


@contextmanager
def _open_flat(path: Path) -> Iterator[_Flat]:
    kind: InputKind = input_kind(path)
    if kind == "checkpoint":
        with open_checkpoint(path) as reader:
            keys = {key_str(k): (k, info) for k, info in reader.walk()}
            yield _Flat(
                {name: info for name, (_, info) in keys.items()}, lambda name: reader.read(keys[name][0], as_numpy=True)
            )
        return
    tree = aggregate_checkpoints(path) if kind == "manifest" else read_state_dict(path, kind)
    flat = flatten(tree)
    yield _Flat({name: _info_of(v) for name, v in flat.items()}, flat.__getitem__)


def diff_paths(path_a: Path, path_b: Path, atol: float, rtol: float) -> tuple[list[Difference], int]:
    """Every difference between the two inputs, and how many keys they share."""
    with _open_flat(path_a) as a, _open_flat(path_b) as b:
        diffs = [Difference("only_a", k) for k in sorted(a.infos.keys() - b.infos.keys())]
        diffs += [Difference("only_b", k) for k in sorted(b.infos.keys() - a.infos.keys())]
        shared = sorted(a.infos.keys() & b.infos.keys())
        for key in shared:
            ia, ib = a.infos[key], b.infos[key]
            if ia.is_array != ib.is_array or (ia.is_array and ia != ib):
                diffs.append(Difference("layout", key, f"{_layout(ia)} vs {_layout(ib)}"))
                continue
            found = compare_values(key, a.read(key), b.read(key), atol, rtol)
            if found is not None:
                diffs.append(found)
    return diffs, len(shared)


# ---- the subcommand --------------------------------------------------------------------------------
def _tolerance(text: str) -> float:
    """argparse type of --atol/--rtol: a number >= 0 (argparse names the option in its error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_command(sub: argparse._SubParsersAction, command) -> None:
    """Register ``diff`` on the CLI's subparsers."""
    p = command(sub, "diff", _run, "compare two checkpoints; exit 0 if equal within tolerance, 1 if not")
    p.add_argument("a", type=path_or_url, metavar="A")
    p.add_argument("b", type=path_or_url, metavar="B")
    p.add_argument("--atol", type=_tolerance, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--rtol", type=_tolerance, default=0.0, help="relative tolerance (default 0: exact)")


def _run(args: argparse.Namespace) -> int:
    diffs, compared = diff_paths(args.a, args.b, args.atol, args.rtol)
    print("\n".join(format_diff(diffs, str(args.a), str(args.b), compared, args.atol, args.rtol)))
    return EXIT_FOUND if diffs else EXIT_OK
