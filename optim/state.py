"""Checks and conversions for optimizer state dicts in the legacy ONNX Runtime layout.

Adam:  ``{param: {"Moment_1": T, "Moment_2": T, "Update_Count": int64 [1]}}``
Lamb:  ``{param: {"Moment_1": T, "Moment_2": T}, "shared_optimizer_state": {"Step": int64 [1]}}``
SGD:   ``{}``
Values may be torch tensors or numpy arrays (what HDF5 gives back); counters may also be ints.
Validation collects every problem before raising, so a load either fully succeeds or changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .layout import FlatLayout

MOMENTS = ("Moment_1", "Moment_2")
UPDATE_COUNT = "Update_Count"
SHARED = "shared_optimizer_state"
STEP = "Step"


def entry_keys(kind: str) -> tuple[str, ...]:
    """Per-parameter keys of optimizer `kind` ('AdamOptimizer', 'LambOptimizer', 'SGDOptimizer')."""
    if kind == "AdamOptimizer":
        return (*MOMENTS, UPDATE_COUNT)
    return MOMENTS if kind == "LambOptimizer" else ()


def find_problems(kind: str, layout: FlatLayout, state: Any, strict: bool, where: str) -> list[str]:
    """Every problem of `state` as a sorted list of lines (missing, then unexpected, then the rest)."""
    if not isinstance(state, Mapping):
        return [f"{where}: expected a dict, got {type(state).__name__}"]
    keys = entry_keys(kind)
    expected: dict[str, tuple[str, ...]] = {name: keys for name in layout.names} if keys else {}
    if kind == "LambOptimizer":
        expected[SHARED] = (STEP,)
    missing, unexpected, other = [], [], []
    for name in expected.keys() - state.keys():
        missing.append(f"{where}[{name}]")
    for name in state.keys() - expected.keys():
        unexpected.append(f"{where}[{name}]")
    for name in expected.keys() & state.keys():
        path, entry = f"{where}[{name}]", state[name]
        if not isinstance(entry, Mapping):
            other.append(f"{path}: expected a dict of optimizer states, got {type(entry).__name__}")
            continue
        missing += [f"{path}[{k}]" for k in set(expected[name]) - entry.keys()]
        unexpected += [f"{path}[{k}]" for k in entry.keys() - set(expected[name])]
        for key in set(expected[name]) & entry.keys():
            if key in MOMENTS:
                problem = _moment_problem(entry[key], layout[name].shape)
            else:
                problem = _counter_problem(entry[key])
            if problem:
                other.append(f"{path}[{key}]: {problem}")
    if not strict:
        missing, unexpected = [], []
    return (
        [f"missing key {p}" for p in sorted(missing)]
        + [f"unexpected key {p}" for p in sorted(unexpected)]
        + sorted(other)
    )


def key_differences(kind: str, layout: FlatLayout, state: Any, where: str) -> tuple[list[str], list[str]]:
    """(missing, unexpected) key paths of ``state`` against the layout, as ``where/name[/key]``, sorted."""
    if not isinstance(state, Mapping):
        return [], []
    keys = entry_keys(kind)
    expected: dict[str, tuple[str, ...]] = {name: keys for name in layout.names} if keys else {}
    if kind == "LambOptimizer":
        expected[SHARED] = (STEP,)
    missing = [f"{where}/{name}" for name in expected.keys() - state.keys()]
    unexpected = [f"{where}/{name}" for name in state.keys() - expected.keys()]
    for name in expected.keys() & state.keys():
        entry = state[name]
        if isinstance(entry, Mapping):
            missing += [f"{where}/{name}/{k}" for k in set(expected[name]) - entry.keys()]
            unexpected += [f"{where}/{name}/{k}" for k in entry.keys() - set(expected[name])]
    return sorted(missing), sorted(unexpected)


def raise_if_invalid(kind: str, layout: FlatLayout, state: Any, strict: bool, where: str) -> None:
    """Raise one ValueError that lists every problem of `state`."""
    problems = find_problems(kind, layout, state, strict, where)
    if not problems:
        return
    hint = ""
    if any(p.startswith(("missing", "unexpected")) for p in problems):
        hint = (
            "\nThe state must come from the same optimizer over the same parameters; pass strict=False "
            "to keep current values for missing entries and ignore unexpected ones."
        )
    lines = "\n  ".join(problems)
    raise ValueError(f"{kind} state is invalid ({len(problems)} problem(s)):\n  {lines}{hint}")


def _meta(value: Any) -> tuple[tuple[int, ...], str, str] | None:
    """(shape, kind, dtype name) of a tensor/array, kind in 'f' (float), 'i' (integer), 'o' (other)."""
    if isinstance(value, torch.Tensor):
        dt = value.dtype
        kind = "f" if dt.is_floating_point else ("o" if dt.is_complex or dt == torch.bool else "i")
        return tuple(value.shape), kind, str(dt).replace("torch.", "")
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        kind = {"f": "f", "i": "i", "u": "i"}.get(arr.dtype.kind, "o")
        return tuple(arr.shape), kind, str(arr.dtype)
    return None


def _moment_problem(value: Any, shape: tuple[int, ...]) -> str | None:
    meta = _meta(value)
    if meta is None:
        return f"expected a torch.Tensor or numpy array, got {type(value).__name__}"
    got_shape, kind, dtype = meta
    if kind != "f":
        return f"wrong dtype: expected a floating-point dtype, got {dtype}"
    if got_shape != shape:
        return f"shape mismatch: expected {shape}, got {got_shape}"
    return None


def _counter_problem(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    else:
        meta = _meta(value)
        if meta is None:
            return f"expected an int or an int64 tensor/array of shape [1], got {type(value).__name__}"
        shape, kind, dtype = meta
        if kind != "i":
            return f"wrong dtype: expected an integer dtype (int64), got {dtype}"
        if shape not in ((), (1,)):
            return f"shape mismatch: expected (1,), got {shape}"
        count = counter_value(value)
    return None if count >= 1 else f"must be >= 1 (counters start at 1), got {count}"


def counter_value(value: Any) -> int:
    """The int held by a validated counter (int, numpy or torch, shape [] or [1])."""
    if isinstance(value, torch.Tensor):
        return int(value.reshape(()).item())
    return int(np.asarray(value).reshape(()))


def as_tensor(value: Any) -> torch.Tensor:
    """A torch view/copy of a validated tensor or numpy array (numpy arrays are copied, native order)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    arr = np.asarray(value)
    return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))


# ------------------------------------------------------------------ counters: the one place they are related
def update_count_for(optimization_step: int) -> int:
    """Adam's per-parameter ``Update_Count`` / LAMB's ``Step`` after ``optimization_step`` updates.

    The legacy counters start at 1 and grow by one per update, so they are always the number of updates
    made plus one; the trainer keeps every parameter's counter there (skipped fp16 steps move neither).
    """
    return int(optimization_step) + 1


def torch_step_for(update_count: int) -> int:
    """``torch.optim`` Adam/AdamW's ``state[p]["step"]`` (updates made) for a legacy counter."""
    return int(update_count) - 1


def counter_mismatches(kind: str, state: Mapping[str, Any], expected: int, where: str, because: str) -> list[str]:
    """Lines naming every counter in ``state`` (validated) that is not ``expected``."""
    if not isinstance(state, Mapping):
        return []
    found: list[tuple[str, Any]] = []
    if kind == "AdamOptimizer":
        found = [
            (f"{where}[{name}][{UPDATE_COUNT}]", entry[UPDATE_COUNT])
            for name, entry in state.items()
            if isinstance(entry, Mapping) and UPDATE_COUNT in entry
        ]
    elif kind == "LambOptimizer" and isinstance(state.get(SHARED), Mapping) and STEP in state[SHARED]:
        found = [(f"{where}[{SHARED}][{STEP}]", state[SHARED][STEP])]
    return [
        f"{path} is {counter_value(value)}, but {because}: it must be {expected}"
        for path, value in found
        if counter_value(value) != expected
    ]
