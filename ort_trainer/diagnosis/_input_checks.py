"""Input problems named in our words instead of a raw torch or ONNX Runtime error.

Three moments: before a step (`check_input_tensors`: meta tensors, empty batches; `check_labels`: class
indices against the number of classes when the graph tells it), when tracing the first step fails
(`graph/_trace_errors.py` re-runs the model and the loss eagerly and names the input at fault), and
when ONNX Runtime fails on an index input (`explain_run_failure`). Each message names the input, what
was expected and what came.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import onnx
import torch

from ..config.model_desc import ModelDescription

__all__ = [
    "LabelSpec",
    "check_input_tensors",
    "check_labels",
    "check_onnx_io",
    "describe_tensor",
    "explain_run_errors",
    "explain_run_failure",
    "find_label_inputs",
    "label_range_message",
]

_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_PASS_THROUGH_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose")
_INDEX_ERROR_WORDS = ("indices", "index", "out of bound", "out of range")


def describe_tensor(tensor: torch.Tensor) -> str:
    """``float32 [2, 3]``: how messages show a tensor."""
    return f"{tensor.dtype} {list(tensor.shape)}"


# ---------------------------------------------------------------------------------------------- before a step
def check_input_tensors(names: Sequence[str], inputs: Sequence[torch.Tensor]) -> None:
    """Meta tensors (no data) and empty batches: ValueError naming every such input."""
    problems = [
        f"input {name!r} is on the meta device (a tensor without data); expected a tensor with data, e.g. on cpu"
        for name, tensor in zip(names, inputs, strict=True)
        if tensor.is_meta
    ]
    problems += [
        f"input {name!r} is empty (shape {list(tensor.shape)}); expected at least one element on every axis "
        "(an empty batch cannot be trained on: skip it)"
        for name, tensor in zip(names, inputs, strict=True)
        if not tensor.is_meta and tensor.numel() == 0
    ]
    if problems:
        raise ValueError("Invalid inputs: " + "; ".join(problems))


@dataclass(frozen=True)
class LabelSpec:
    """A ``model_desc`` input that reaches a loss node as class indices."""

    name: str
    classes: int | None  # None: the graph does not say (checked only when ORT fails)
    ignore_index: int | None
    op: str
    # False: a label on a GPU is not checked before each run (the check would be a host round trip per step);
    # the autograd engine's and ORTModule's checks, where the graph's gather would wrap a negative label silently
    on_device: bool = True


def find_label_inputs(forward: onnx.ModelProto, input_names: Sequence[str]) -> list[LabelSpec]:
    """Inputs that feed the label of a cross-entropy / NLL node (through reshapes and casts only)."""
    producer = {out: node for node in forward.graph.node for out in node.output}
    shapes = _static_dims(forward)
    specs = []
    for node in forward.graph.node:
        if node.op_type not in _LOSS_OPS or len(node.input) < 2:
            continue
        source = _trace_back(node.input[1], producer)
        if source in input_names:
            dims = shapes.get(node.input[0], ())
            classes = dims[1] if len(dims) > 1 else None
            ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
            specs.append(LabelSpec(source, classes, ignore, node.op_type))
    return specs


def _trace_back(name: str, producer: Mapping[str, onnx.NodeProto]) -> str:
    node = producer.get(name)
    while node is not None and node.op_type in _PASS_THROUGH_OPS and node.input:
        name = node.input[0]
        node = producer.get(name)
    return name


def _static_dims(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - no shapes: the class count stays unknown, ORT's failure is translated instead
        return {}
    dims = {}
    for info in [*graph.value_info, *graph.input, *graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            shape = info.type.tensor_type.shape.dim
            dims[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in shape)
    return dims


def check_labels(specs: Sequence[LabelSpec], feeds: Mapping[str, torch.Tensor]) -> None:
    """Class indices in [0, classes) (or ignore_index), where the number of classes is known."""
    for spec in specs:
        label = feeds.get(spec.name)
        if label is None or spec.classes is None or label.is_floating_point():
            continue
        if not spec.on_device and label.device.type != "cpu":
            continue
        bad = _out_of_range(label, spec.classes, spec.ignore_index)
        if bad:
            raise ValueError(_range_message(spec.name, bad, spec.classes, spec.ignore_index))


def label_range_message(name: str, label: torch.Tensor, classes: int, ignore_index: int | None) -> str | None:
    """The message for class indices of ``label`` outside ``[0, classes)``; None when all are in range."""
    bad = _out_of_range(label, classes, ignore_index)
    return _range_message(name, bad, classes, ignore_index) if bad else None


def _out_of_range(label: torch.Tensor, classes: int, ignore_index: int | None) -> list[int]:
    """Up to 5 distinct values of ``label`` outside [0, classes) that are not ``ignore_index``, sorted."""
    if label.numel() == 0:
        return []
    if (
        label.device.type == "cpu" and label.dtype != torch.bool
    ):  # the common case in one pass: every label a class (no ignore_index either)
        low, high = torch.aminmax(label)
        if int(low) >= 0 and int(high) < classes:
            return []
    wrong = (label < 0) | (label >= classes)
    if ignore_index is not None:
        wrong &= label != ignore_index
    if not bool(wrong.any()):
        return []
    return sorted({int(v) for v in label[wrong].unique()[:5].tolist()})


def _range_message(name: str, bad: list[int], classes: int, ignore_index: int | None) -> str:
    ignore = f", or the ignore_index {ignore_index}" if ignore_index is not None else ""
    return (
        f"input {name!r} holds class indices {bad} out of range: the model predicts {classes} classes, so a label "
        f"must be in [0, {classes - 1}] (the range [0, {classes})){ignore}"
    )


def explain_run_failure(specs: Sequence[LabelSpec], feeds: Mapping[str, torch.Tensor], error: Exception):
    """ONNX Runtime's failure on an index, re-worded around the label inputs; None if it is about something else."""
    text = str(error).lower()
    if not specs or not any(word in text for word in _INDEX_ERROR_WORDS):
        return None
    parts = []
    for spec in specs:
        label = feeds.get(spec.name)
        if label is not None and label.numel() and not label.is_floating_point():
            parts.append(f"input {spec.name!r} holds values in [{int(label.min())}, {int(label.max())}]")
    if not parts:
        return None
    return ValueError(
        f"ONNX Runtime failed on an index: {'; '.join(parts)}, which reach the loss as class indices; each must be "
        f"in [0, number of classes) or the ignore_index. ONNX Runtime said: {error}"
    )


@contextlib.contextmanager
def explain_run_errors(
    specs: Sequence[LabelSpec],
    traced: Sequence[tuple[int, ...]],
    names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    feeds: Mapping[str, torch.Tensor],
    explain: Callable[[Mapping[str, torch.Tensor], Exception], Exception | None] = lambda feeds, error: None,
) -> Iterator[None]:
    """ORT's failure on a label index or on a shape the exporter baked in, re-raised naming the input.

    ``explain`` (the session's `StepSession.explain_failure`) has the first word: the engine may name the input
    at fault in PyTorch's own terms."""
    try:
        yield
    except Exception as error:  # onnxruntime raises its own exception types (Fail, RuntimeException, ...)
        explained = explain(feeds, error)
        if explained is None:
            explained = explain_run_failure(specs, feeds, error)
        if explained is not None:
            raise explained from error
        _explain_shape_error(names, inputs, traced, error)
        raise


def _explain_shape_error(
    names: Sequence[str], inputs: Sequence[torch.Tensor], traced: Sequence[tuple[int, ...]], error: Exception
) -> None:
    """ORT's failure on a shape the exporter baked in as a constant, re-raised naming the input and axis."""
    changed = [
        f"{name} axis {axis}: traced with {old}, got {new}"
        for name, tensor, shape in zip(names, inputs, traced, strict=True)
        for axis, (old, new) in enumerate(zip(shape, tensor.shape, strict=False))
        if old != new
    ]
    if changed:
        raise ValueError(
            f"ONNX Runtime failed on inputs whose shapes differ from the ones the graph was traced with "
            f"({'; '.join(changed)}). The TorchScript exporter sometimes bakes a dimension declared dynamic into "
            "the graph (e.g. the sequence length inside nn.MultiheadAttention); keep that dimension fixed "
            f"(pad your inputs) or declare it as an int in model_desc. ONNX Runtime said: {error}"
        ) from error


def check_onnx_io(model: onnx.ModelProto, desc: ModelDescription) -> None:
    """A user-given ONNX model must have every ``model_desc`` input and output (initializers are not inputs)."""
    initializers = {init.name for init in model.graph.initializer}
    graph_inputs = [i.name for i in model.graph.input if i.name not in initializers]
    graph_outputs = [o.name for o in model.graph.output]
    missing_in = [n for n in desc.input_names if n not in graph_inputs]
    missing_out = [n for n in desc.output_names if n not in graph_outputs]
    if missing_in or missing_out:
        raise ValueError(
            f"model_desc does not match the ONNX model: inputs {missing_in} / outputs {missing_out} are not in "
            f"the graph (graph inputs {graph_inputs}, graph outputs {graph_outputs})"
        )
