"""Input problems named in our words instead of a raw torch or ONNX Runtime error.

Three moments: before a step (`check_input_tensors`: meta tensors, empty batches; `check_labels`: class
indices against the number of classes when the graph tells it), when tracing the first step fails
(`explain_trace_failure`: re-runs the model and the loss eagerly to find which input is at fault), and
when ONNX Runtime fails on an index input (`explain_run_failure`). Each message names the input, what
was expected and what came.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import onnx
import torch

from ort_trainer.graph._forward import (
    OutputContractError,
    OutputContractTypeError,
    bind_forward_inputs,
    model_input_names,
    module_for_export,
)

from ..config.model_desc import ModelDescription

__all__ = [
    "LabelSpec",
    "check_input_tensors",
    "check_labels",
    "check_onnx_io",
    "explain_run_errors",
    "explain_run_failure",
    "explain_trace_failure",
    "find_label_inputs",
]

_TORCH_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)  # what torch raises on bad inputs
_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_PASS_THROUGH_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose")
_INDEX_ERROR_WORDS = ("indices", "index", "out of bound", "out of range")


def _describe(tensor: torch.Tensor) -> str:
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
        bad = _out_of_range(label, spec.classes, spec.ignore_index)
        if bad:
            raise ValueError(_range_message(spec.name, bad, spec.classes, spec.ignore_index))


def _out_of_range(label: torch.Tensor, classes: int, ignore_index: int | None) -> list[int]:
    wrong = (label < 0) | (label >= classes)
    if ignore_index is not None:
        wrong &= label != ignore_index
    if not bool(wrong.any()):
        return []
    return sorted({int(v) for v in label[wrong].unique()[:5].tolist()})


def _range_message(name: str, bad: list[int], classes: int, ignore_index: int | None) -> str:
    ignore = f" or the ignore_index {ignore_index}" if ignore_index is not None else ""
    return (
        f"input {name!r} holds class indices {bad} out of range: the model predicts {classes} classes, so a label "
        f"must be in [0, {classes - 1}]{ignore}"
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
) -> Iterator[None]:
    """ORT's failure on a label index or on a shape the exporter baked in, re-raised naming the input."""
    try:
        yield
    except Exception as error:  # onnxruntime raises its own exception types (Fail, RuntimeException, ...)
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



# ---------------------------------------------------------------------------------------------- first step
def explain_trace_failure(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    desc: ModelDescription,
    inputs: Sequence[torch.Tensor],
    error: Exception,
) -> Exception | None:
    """Why tracing the first step failed, as an error naming the input at fault; None: not an input problem.

    The model and the loss run again eagerly (on a copy, or on the restored module) to tell a model
    that rejects an input from a loss that rejects the label from an exporter problem.
    """
    if isinstance(error, OutputContractError | OutputContractTypeError) or not isinstance(error, _TORCH_ERRORS):
        return None
    names = desc.input_names
    dtype_problem = _float_dtype_mismatch(model, names, inputs)
    if dtype_problem is not None:
        return TypeError(f"{dtype_problem} (the first step failed with: {error})")
    model_names = model_input_names(desc, loss_fn)
    with module_for_export(model, warn=False) as module, torch.no_grad():
        binding = bind_forward_inputs(module, model_names)
        module.train()
        try:
            preds = binding.call(module, inputs[: len(model_names)])
        except _TORCH_ERRORS as eager:
            listed = ", ".join(f"{n} ({_describe(t)})" for n, t in zip(model_names, inputs, strict=False))
            return ValueError(f"{binding.where}() failed on the inputs {listed}: {eager}")
        if loss_fn is None:
            return None
        try:
            loss_fn(preds, inputs[-1])
        except _TORCH_ERRORS as eager:
            return _explain_loss_failure(loss_fn, preds, names[-1], inputs[-1], eager)
    return None


def _float_dtype_mismatch(model: torch.nn.Module, names: Sequence[str], inputs: Sequence[torch.Tensor]) -> str | None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return None
    (expected,) = dtypes
    wrong = [
        f"input {name!r} has dtype {tensor.dtype}, but the model's parameters are {expected}"
        for name, tensor in zip(names, inputs, strict=True)
        if tensor.is_floating_point() and tensor.dtype != expected
    ]
    if not wrong:
        return None
    return "; ".join(wrong) + f": pass floating-point inputs as {expected} (e.g. tensor.to({expected}))"


def _classification_loss(loss_fn: Callable) -> tuple[str, int] | None:
    """(name, ignore_index) of PyTorch's class-index losses; None for any other loss_fn."""
    functional = {torch.nn.functional.cross_entropy: "cross_entropy", torch.nn.functional.nll_loss: "nll_loss"}
    with contextlib.suppress(TypeError):  # an unhashable callable is no function of ours
        if loss_fn in functional:
            return functional[loss_fn], -100
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss | torch.nn.NLLLoss):
        return type(loss_fn).__name__, int(loss_fn.ignore_index)
    return None


def _explain_loss_failure(loss_fn: Callable, preds, name: str, label: torch.Tensor, error: Exception) -> Exception:
    known = _classification_loss(loss_fn)
    if known is not None and isinstance(preds, torch.Tensor) and preds.dim() >= 1:
        loss_name, ignore_index = known
        classes = preds.shape[1] if preds.dim() >= 2 else preds.shape[0]
        if label.is_floating_point() and label.shape != preds.shape:
            return TypeError(
                f"input {name!r} has dtype {label.dtype} and shape {list(label.shape)}, but {loss_name} expects "
                f"integer class indices (torch.int64) in [0, {classes - 1}], or float class probabilities of the "
                f"prediction's shape {list(preds.shape)}"
            )
        if not label.is_floating_point():
            bad = _out_of_range(label, classes, ignore_index)
            if bad:
                return ValueError(_range_message(name, bad, classes, ignore_index))
    predicted = _describe(preds) if isinstance(preds, torch.Tensor) else type(preds).__name__
    hint = " (a classification loss needs integer class indices, e.g. torch.int64)" if label.is_floating_point() else ""
    return ValueError(
        f"loss_fn failed on the model's prediction ({predicted}) and input {name!r} ({_describe(label)}){hint}: "
        f"{error}"
    )


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
