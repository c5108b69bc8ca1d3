"""Model description: the names and shapes of a model's inputs and outputs, validated once.

The user writes the legacy form ``{"inputs": [(name, shape)], "outputs": [(name, shape, is_loss)]}``;
``validate_model_desc`` checks it completely (one ValueError listing every problem) and returns the
legacy namedtuples (``InputDescription(name, shape)``, ``OutputDescription(name, shape, is_loss)``, and
their ``...Typed`` forms once dtypes are known; ``shape`` is a list). String dims are symbolic (dynamic)
axes; ``check_inputs`` verifies call-time tensors against the description, including that a symbolic
dim has one size across inputs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

__all__ = [
    "InputDescription",
    "InputDescriptionTyped",
    "ModelDescription",
    "OutputDescription",
    "OutputDescriptionTyped",
    "check_inputs",
    "validate_model_desc",
]

Dim = str | int
_VALID_KEYS = ("inputs", "outputs")


class InputDescription(NamedTuple):
    """One model input before its dtype is known: ``(name, shape)``, as the legacy ORTTrainer's namedtuple.

    ``shape`` is a list (str dims are symbolic). After the first step the trainer's ``model_desc`` holds
    ``InputDescriptionTyped`` records instead, with the dtype of the tensors the graph was built for.
    """

    name: str
    shape: list[Dim]

    @property
    def dtype(self) -> torch.dtype | None:
        return None


class InputDescriptionTyped(NamedTuple):
    """One model input with its dtype: ``(name, shape, dtype)`` (legacy ``InputDescriptionTyped``)."""

    name: str
    shape: list[Dim]
    dtype: torch.dtype


class OutputDescription(NamedTuple):
    """One model output before its dtype is known: ``(name, shape, is_loss)`` (legacy namedtuple)."""

    name: str
    shape: list[Dim]
    is_loss: bool = False

    @property
    def dtype(self) -> torch.dtype | None:
        return None

    @property
    def dtype_amp(self) -> torch.dtype | None:
        return None


class OutputDescriptionTyped(NamedTuple):
    """One output with its dtype: ``(name, shape, is_loss, dtype, dtype_amp)`` (legacy ``OutputDescriptionTyped``).

    ``dtype_amp`` stays None: with mixed precision our graph outputs keep their float32 type.
    """

    name: str
    shape: list[Dim]
    is_loss: bool
    dtype: torch.dtype
    dtype_amp: torch.dtype | None = None


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _dynamic_axes(shape: Sequence[Dim]) -> dict[int, str]:
    return {axis: dim for axis, dim in enumerate(shape) if isinstance(dim, str)}


@dataclass(frozen=True)
class ModelDescription:
    """Validated description of a model's inputs and outputs (build it with ``validate_model_desc``)."""

    inputs: tuple[InputDescription | InputDescriptionTyped, ...]
    outputs: tuple[OutputDescription | OutputDescriptionTyped, ...]

    @property
    def input_names(self) -> list[str]:
        return [d.name for d in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [d.name for d in self.outputs]

    @property
    def loss_index(self) -> int | None:
        """Position of the loss among the outputs, or None when no output is the loss."""
        return next((i for i, d in enumerate(self.outputs) if d.is_loss), None)

    @property
    def loss_output(self) -> OutputDescription | OutputDescriptionTyped | None:
        index = self.loss_index
        return None if index is None else self.outputs[index]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """``{name: {axis: dim_name}}`` for every input/output with symbolic dims (for torch.onnx.export)."""
        return {d.name: _dynamic_axes(d.shape) for d in (*self.inputs, *self.outputs) if _dynamic_axes(d.shape)}

    def with_input_dtypes(self, dtypes: Mapping[str, torch.dtype] | Sequence[torch.dtype]) -> ModelDescription:
        """A copy whose inputs carry ``dtypes`` (by name, or one per input in order)."""
        return replace(self, inputs=_with_dtypes("input", self.inputs, dtypes))

    def with_output_dtypes(self, dtypes: Mapping[str, torch.dtype] | Sequence[torch.dtype]) -> ModelDescription:
        """A copy whose outputs carry ``dtypes`` (by name, or one per output in order)."""
        return replace(self, outputs=_with_dtypes("output", self.outputs, dtypes))

    def to_dict(self) -> dict[str, list[tuple[Any, ...]]]:
        """The legacy nested form (dtypes are not part of it)."""
        return {
            "inputs": [(d.name, list(d.shape)) for d in self.inputs],
            "outputs": [(d.name, list(d.shape), d.is_loss) for d in self.outputs],
        }


def _with_dtypes(kind: str, descs: tuple[Any, ...], dtypes: Any) -> tuple[Any, ...]:
    names = [d.name for d in descs]
    if isinstance(dtypes, Mapping):
        unknown = sorted(set(dtypes) - set(names), key=str)
        if unknown:
            raise ValueError(f"unknown {kind} name(s) {unknown}; the {kind}s are {names}")
        by_name = dict(dtypes)
    elif isinstance(dtypes, Sequence) and not isinstance(dtypes, str):
        if len(dtypes) != len(descs):
            raise ValueError(f"expected {len(descs)} {kind} dtypes (for {names}), got {len(dtypes)}")
        by_name = dict(zip(names, dtypes, strict=True))
    else:
        raise TypeError(f"{kind} dtypes must be a mapping name -> torch.dtype or a sequence, got {_got(dtypes)}")
    bad = sorted(f"{name!r}: {dt!r}" for name, dt in by_name.items() if not isinstance(dt, torch.dtype))
    if bad:
        raise TypeError(f"{kind} dtypes must be torch.dtype; got {', '.join(bad)}")
    return tuple(_typed(d, by_name[d.name]) if d.name in by_name else d for d in descs)


def _typed(desc: Any, dtype: torch.dtype) -> Any:
    if isinstance(desc, InputDescription | InputDescriptionTyped):
        return InputDescriptionTyped(desc.name, list(desc.shape), dtype)
    return OutputDescriptionTyped(desc.name, list(desc.shape), desc.is_loss, dtype, desc.dtype_amp)


# ---------------------------------------------------------------------------------------------
# validation of the legacy dict


def _sort_key(problem: str) -> list[Any]:
    """Sort problems by path with numeric indices compared as numbers (inputs[2] before inputs[10])."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", problem.split(":", 1)[0])]


def _check_shape(path: str, shape: Any, problems: list[str]) -> list[Dim] | None:
    if not isinstance(shape, list | tuple):
        problems.append(f"{path}: the second element of the tuple (aka shape) must be a list, got {_got(shape)}")
        return None
    ok = True
    for axis, dim in enumerate(shape):
        where = f"{path}.shape[{axis}]"
        if isinstance(dim, bool) or not isinstance(dim, str | int):
            problems.append(f"{where}: each shape must be either a string or integer, got {_got(dim)}")
        elif isinstance(dim, int) and dim < 1:
            problems.append(f"{where}: integer dims must be >= 1 (use a string for a dynamic dim), got {dim}")
        elif isinstance(dim, str) and not dim:
            problems.append(f"{where}: symbolic (string) dims must be non-empty")
        else:
            continue
        ok = False
    return list(shape) if ok else None


def _check_item(path: str, item: Any, sizes: tuple[int, ...], problems: list[str]) -> tuple[Any, ...] | None:
    """Check one (name, shape[, is_loss]) entry; return its fields, or None if it is invalid."""
    size_text = " or ".join(str(n) for n in sizes)
    if not isinstance(item, tuple | list) or len(item) not in sizes:
        got = f"{len(item)} elements" if isinstance(item, tuple | list) else _got(item)
        problems.append(f"{path}: must be a tuple with size {size_text}, got {got}")
        return None
    n_before = len(problems)
    name = item[0]
    if not isinstance(name, str):
        problems.append(f"{path}: the first element of the tuple (aka name) must be a string, got {_got(name)}")
    elif not name:
        problems.append(f"{path}: the first element of the tuple (aka name) must not be empty")
    shape = _check_shape(path, item[1], problems)
    is_loss = item[2] if len(item) == 3 else False
    if not isinstance(is_loss, bool):
        problems.append(f"{path}: the third element of the tuple (aka is_loss) must be a boolean, got {_got(is_loss)}")
    return None if len(problems) > n_before else (name, shape, is_loss)


def _check_list(desc: Mapping[str, Any], key: str, sizes: tuple[int, ...], problems: list[str]) -> list[tuple] | None:
    if key not in desc:
        problems.append(f"{key}: required field")
        return None
    items = desc[key]
    if not isinstance(items, list | tuple):
        problems.append(f"{key}: must be a list, got {type(items).__name__}")
        return None
    if not items:
        problems.append(f"{key}: must be a non-empty list (min length is 1)")
        return None
    checked = [_check_item(f"{key}[{i}]", item, sizes, problems) for i, item in enumerate(items)]
    names = [c[0] for c in checked if c is not None]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"{key}: names must be unique, duplicated: {duplicates}")
    return None if any(c is None for c in checked) else checked


def _check_loss(outputs: list[tuple], require_loss: bool, problems: list[str]) -> None:
    losses = [f"outputs[{i}]" for i, (_, _, is_loss) in enumerate(outputs) if is_loss]
    if len(losses) > 1:
        problems.append(f"outputs: only one is_loss can be set to True, got {len(losses)} ({', '.join(losses)})")
    elif require_loss and not losses:
        problems.append("outputs: exactly one output must have is_loss=True (the loss), got none")


def _raise_if_any(problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in sorted(problems, key=_sort_key))
        raise ValueError(f"Invalid model_desc: {len(problems)} problem(s):\n{lines}")


def validate_model_desc(model_desc: Mapping[str, Any] | ModelDescription, *, require_loss: bool) -> ModelDescription:
    """Validate the legacy ``model_desc`` dict and return a ``ModelDescription``.

    ``require_loss=True`` (ONNX models, whose graph computes the loss) demands exactly one
    ``is_loss=True`` output; otherwise at most one is allowed. Every problem is reported in one
    ``ValueError("Invalid model_desc: ...")``, sorted by path. A ``ModelDescription`` is returned
    as is once the loss requirement holds.
    """
    problems: list[str] = []
    if isinstance(model_desc, ModelDescription):
        _check_loss([(d.name, d.shape, d.is_loss) for d in model_desc.outputs], require_loss, problems)
        _raise_if_any(problems)
        return model_desc
    if not isinstance(model_desc, Mapping):
        raise ValueError(
            f"Invalid model_desc: expected a dict with keys {list(_VALID_KEYS)}, got {type(model_desc).__name__}"
        )
    problems += [
        f"{key!r}: unknown field (valid keys: {', '.join(_VALID_KEYS)})" for key in model_desc if key not in _VALID_KEYS
    ]
    inputs = _check_list(model_desc, "inputs", (2,), problems)
    outputs = _check_list(model_desc, "outputs", (2, 3), problems)
    if outputs is not None:
        _check_loss(outputs, require_loss, problems)
    _raise_if_any(problems)
    return ModelDescription(
        inputs=tuple(InputDescription(name, list(shape)) for name, shape, _ in inputs),
        outputs=tuple(OutputDescription(name, list(shape), is_loss) for name, shape, is_loss in outputs),
    )


# ---------------------------------------------------------------------------------------------
# call-time checks


def _shape_problems(desc: ModelDescription, inputs: Sequence[torch.Tensor]) -> list[str]:
    """Rank, fixed dims, and one size per symbolic dim across all inputs."""
    problems: list[str] = []
    seen: dict[str, list[tuple[str, int, int]]] = {}
    for d, tensor in zip(desc.inputs, inputs, strict=True):
        if tensor.dim() != len(d.shape):
            problems.append(
                f"input {d.name!r}: expected rank {len(d.shape)} (shape {list(d.shape)}), "
                f"got rank {tensor.dim()} (shape {list(tensor.shape)})"
            )
            continue
        for axis, (dim, size) in enumerate(zip(d.shape, tensor.shape, strict=True)):
            if isinstance(dim, int) and dim != size:
                problems.append(f"input {d.name!r} axis {axis}: expected size {dim}, got {size}")
            elif isinstance(dim, str):
                seen.setdefault(dim, []).append((d.name, axis, size))
    for dim, uses in sorted(seen.items()):
        if len({size for _, _, size in uses}) > 1:
            where = ", ".join(f"{name!r} axis {axis} = {size}" for name, axis, size in uses)
            problems.append(f"dim {dim!r} must have one size across inputs, got {where}")
    return problems


def check_inputs(desc: ModelDescription, inputs: Sequence[torch.Tensor]) -> None:
    """Check call-time ``inputs`` against ``desc``: count, tensor type, dtype (TypeError), shapes (ValueError).

    Each error lists every offending input.
    """
    if len(inputs) != len(desc.inputs):
        raise ValueError(f"expected {len(desc.inputs)} input(s) {desc.input_names}, got {len(inputs)}")
    type_problems = [
        f"input {d.name!r} (position {i}) must be a torch.Tensor, got {type(t).__name__}"
        for i, (d, t) in enumerate(zip(desc.inputs, inputs, strict=True))
        if not isinstance(t, torch.Tensor)
    ]
    type_problems += [
        f"input {d.name!r} must have dtype {d.dtype}, got {t.dtype}"
        for d, t in zip(desc.inputs, inputs, strict=True)
        if isinstance(t, torch.Tensor) and d.dtype is not None and t.dtype != d.dtype
    ]
    if type_problems:
        raise TypeError("Invalid inputs: " + "; ".join(type_problems))
    shape_problems = _shape_problems(desc, inputs)
    if shape_problems:
        raise ValueError("Invalid inputs: " + "; ".join(shape_problems))
