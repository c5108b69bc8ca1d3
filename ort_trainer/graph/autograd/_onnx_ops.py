"""Standard ONNX ops as torch ops: what `OnnxModule` runs for the nodes that compute on tensors.

Each entry of `TORCH_OPS` takes the node (`OnnxNode`: attributes, opset, train/eval mode) and its inputs, and
returns its outputs. An input is a torch tensor when it depends on the model's inputs or parameters, or a numpy
array when it is known at trace time (a constant, an integer initializer, a shape: `OnnxModule` computes those
with ``onnx.reference``); an op that needs a value at trace time (Reshape's shape, Slice's starts, the axes of a
reduction) reads it with `static_ints`. The gradients are PyTorch's own: the engine traces these ops under
``torch.autograd.grad`` like any module's. Only the ops listed here have a route; `OnnxModule` refuses the others
by name when the trainer is made.

Coverage: what the TorchScript and dynamo exporters write for MLPs, CNNs and transformers (elementwise math,
shapes, indexing, reductions here; Gemm, convolution, pooling, normalisation, Dropout, Softmax and the ONNX losses
in `_onnx_nn_ops`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ._onnx_nn_ops import NN_OPS
from ._onnx_node import TORCH_DTYPES, OnnxNode, Value, as_tensor, input_or_attr, static_float, static_ints

__all__ = ["TORCH_OPS"]


def _elementwise(function: Callable) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        return [function(*[as_tensor(v, inputs) for v in inputs])]

    return run


def _variadic(function: Callable) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        return [functools.reduce(function, [as_tensor(v, inputs) for v in inputs])]

    return run


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    integral = not (a.is_floating_point() or b.is_floating_point())
    return torch.div(a, b, rounding_mode="trunc") if integral else a / b


def _mod(node, inputs):
    a, b = as_tensor(inputs[0], inputs), as_tensor(inputs[1], inputs)
    return [torch.fmod(a, b) if node.attrs.get("fmod", 0) else torch.remainder(a, b)]  # fmod=0: the divisor's sign


def _cast(node, inputs):
    return [as_tensor(inputs[0]).to(TORCH_DTYPES[node.attrs["to"]])]


def _clip(node, inputs):
    x = as_tensor(inputs[0])
    low = inputs[1] if len(inputs) > 1 else node.attrs.get("min")
    high = inputs[2] if len(inputs) > 2 else node.attrs.get("max")
    low, high = (None if v is None else v.item() if isinstance(v, np.ndarray) else v for v in (low, high))
    return [torch.clamp(x, low, high)]


def _flatten(node, inputs):
    x = as_tensor(inputs[0])
    axis = node.attrs.get("axis", 1) % (x.dim() + 1) if x.dim() else 0
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


def _reshape(node, inputs):
    x, shape = as_tensor(inputs[0]), static_ints(node, inputs[1], "shape")
    if not node.attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x.reshape(shape)]


def _transpose(node, inputs):
    x = as_tensor(inputs[0])
    return [x.permute(node.attrs.get("perm", list(reversed(range(x.dim())))))]


def _squeeze(node, inputs):
    x = as_tensor(inputs[0])
    axes = input_or_attr(node, inputs, 1, "axes", "axes")
    return [x.squeeze() if axes is None else x.squeeze(tuple(axes))]


def _unsqueeze(node, inputs):
    x = as_tensor(inputs[0])
    axes = input_or_attr(node, inputs, 1, "axes", "axes") or []
    rank = x.dim() + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return [x]


def _concat(node, inputs):
    return [torch.cat([as_tensor(v, inputs) for v in inputs], dim=node.attrs["axis"])]


def _split(node, inputs):
    x, axis = as_tensor(inputs[0]), node.attrs.get("axis", 0)
    sizes = input_or_attr(node, inputs, 1, "split", "split sizes")
    if sizes is None:
        parts = node.attrs.get("num_outputs", len(node.outputs))
        step = math.ceil(x.shape[axis] / parts)
        sizes = [min(step, x.shape[axis] - i * step) for i in range(parts)]
    return list(torch.split(x, sizes, dim=axis))


def _slice(node, inputs):
    x = as_tensor(inputs[0])
    if node.opset < 10:
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes"), None
    else:
        starts, ends = static_ints(node, inputs[1], "starts"), static_ints(node, inputs[2], "ends")
        axes = input_or_attr(node, inputs, 3, "-", "axes")
        steps = input_or_attr(node, inputs, 4, "-", "steps")
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= x.dim()
        begin, stop, stride = slice(start, end, step).indices(x.shape[axis])  # ONNX's clamping is Python's
        if stride > 0:
            x = x[(slice(None),) * axis + (slice(begin, stop, stride),)]
        else:  # torch slices only forwards
            index = torch.as_tensor(list(range(begin, stop, stride)), dtype=torch.long, device=x.device)
            x = x.index_select(axis, index)
    return [x]


def _gather(node, inputs):
    x, axis = as_tensor(inputs[0], inputs), node.attrs.get("axis", 0)
    axis %= x.dim()
    index = inputs[1]
    if isinstance(index, np.ndarray):
        index = as_tensor(np.where(index < 0, index + x.shape[axis], index).astype(np.int64), inputs)
    else:
        index = torch.where(index < 0, index + x.shape[axis], index)
    picked = x.index_select(axis, index.reshape(-1))
    return [picked.reshape(*x.shape[:axis], *index.shape, *x.shape[axis + 1 :])]


def _gather_elements(node, inputs):
    x, index = as_tensor(inputs[0], inputs), as_tensor(inputs[1], inputs)
    axis = node.attrs.get("axis", 0) % x.dim()
    return [torch.gather(x, axis, torch.where(index < 0, index + x.shape[axis], index))]


def _expand(node, inputs):
    x = as_tensor(inputs[0])
    return [x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(static_ints(node, inputs[1], "shape"))))]


def _tile(node, inputs):
    return [as_tensor(inputs[0]).repeat(static_ints(node, inputs[1], "repeats"))]


def _pad(node, inputs):
    x = as_tensor(inputs[0])
    pads = input_or_attr(node, inputs, 1, "pads", "pads")
    axes = input_or_attr(node, inputs, 3, "-", "axes")
    axes = [a % x.dim() for a in axes] if axes is not None else list(range(x.dim()))
    begin, end = dict(zip(axes, pads[: len(axes)], strict=True)), dict(zip(axes, pads[len(axes) :], strict=True))
    torch_pads = [p for d in reversed(range(x.dim())) for p in (begin.get(d, 0), end.get(d, 0))]
    while len(torch_pads) > 2 and torch_pads[-2:] == [0, 0]:  # torch pads from the last dim: outer zeros dropped
        torch_pads = torch_pads[:-2]
    mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}
    mode = mode[node.attrs.get("mode", "constant")]
    value = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    if mode != "constant" or not isinstance(value, torch.Tensor):
        value = static_float(node, inputs, 2, "constant_value", 0.0) if mode == "constant" else None
        return [F.pad(x, torch_pads, mode=mode, value=value)]
    # the padding value is a parameter (a float initializer): padded as 0, then the value added where padded
    border = F.pad(torch.zeros_like(x), torch_pads, value=1.0)
    return [F.pad(x, torch_pads) + border * value.to(x.dtype)]


def _reduce(function: Callable) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        x = as_tensor(inputs[0])
        axes = input_or_attr(node, inputs, 1, "axes", "axes")
        if not axes and node.attrs.get("noop_with_empty_axes", 0):
            return [x]
        dims = tuple(range(x.dim())) if not axes else tuple(a % x.dim() for a in axes)
        return [function(x, dims, bool(node.attrs.get("keepdims", 1)))]

    return run


def _prod(x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    for d in sorted(dims, reverse=True):
        x = x.prod(d, keepdim=keep)
    return x


def _arg(function: Callable) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        if node.attrs.get("select_last_index", 0):
            raise node.fail("select_last_index=1")
        return [function(as_tensor(inputs[0]), node.attrs.get("axis", 0), bool(node.attrs.get("keepdims", 1)))]

    return run


def _shape(node, inputs):
    shape = list(inputs[0].shape)
    return [np.array(shape[node.attrs.get("start", 0) : node.attrs.get("end", len(shape))], dtype=np.int64)]


def _cumsum(node, inputs):
    x, axis = as_tensor(inputs[0]), static_ints(node, inputs[1], "axis")[0]
    reverse, exclusive = node.attrs.get("reverse", 0), node.attrs.get("exclusive", 0)
    y = x.flip(axis) if reverse else x
    y = torch.cumsum(y, axis) - (y if exclusive else 0)
    return [y.flip(axis) if reverse else y]


def _trilu(node, inputs):
    k = static_ints(node, inputs[1], "k")[0] if len(inputs) > 1 and inputs[1] is not None else 0
    x = as_tensor(inputs[0])
    return [torch.triu(x, k) if node.attrs.get("upper", 1) else torch.tril(x, k)]


def _selu(x: torch.Tensor, alpha: float, gamma: float) -> torch.Tensor:
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


def _with_attrs(function: Callable, **defaults: Any) -> Callable:
    """An elementwise op whose float attributes (alpha, beta...) are passed by keyword."""

    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        return [function(as_tensor(inputs[0]), **{k: node.attrs.get(k, v) for k, v in defaults.items()})]

    return run


_UNARY = {
    "Abs": torch.abs, "Ceil": torch.ceil, "Cos": torch.cos, "Erf": torch.erf, "Exp": torch.exp,
    "Floor": torch.floor, "Identity": lambda x: x, "IsNaN": torch.isnan, "Log": torch.log, "Neg": torch.neg,
    "Not": torch.logical_not, "Reciprocal": torch.reciprocal, "Relu": torch.relu, "Round": torch.round,
    "Sigmoid": torch.sigmoid, "Sign": torch.sign, "Sin": torch.sin, "Softplus": F.softplus, "Sqrt": torch.sqrt,
    "Tanh": torch.tanh, "HardSwish": F.hardswish,
}  # fmt: skip
_BINARY = {
    "Add": torch.add, "And": torch.logical_and, "Div": _div, "Equal": torch.eq, "Greater": torch.gt,
    "GreaterOrEqual": torch.ge, "Less": torch.lt, "LessOrEqual": torch.le, "MatMul": torch.matmul, "Mul": torch.mul,
    "Or": torch.logical_or, "Pow": torch.pow, "Sub": torch.sub, "Where": torch.where, "Xor": torch.logical_xor,
    "PRelu": lambda x, slope: torch.where(x < 0, slope * x, x),
}  # fmt: skip
_REDUCE = {
    "ReduceSum": lambda x, d, k: x.sum(d, keepdim=k), "ReduceMean": lambda x, d, k: x.mean(d, keepdim=k),
    "ReduceMax": lambda x, d, k: x.amax(d, keepdim=k), "ReduceMin": lambda x, d, k: x.amin(d, keepdim=k),
    "ReduceProd": _prod, "ReduceSumSquare": lambda x, d, k: (x * x).sum(d, keepdim=k),
    "ReduceL2": lambda x, d, k: (x * x).sum(d, keepdim=k).sqrt(),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
}  # fmt: skip

TORCH_OPS: dict[str, Callable[[OnnxNode, Sequence[Value]], list]] = {
    **{op: _elementwise(f) for op, f in {**_UNARY, **_BINARY}.items()},
    **{op: _reduce(f) for op, f in _REDUCE.items()},
    "Sum": _variadic(torch.add), "Max": _variadic(torch.maximum), "Min": _variadic(torch.minimum),
    "Mean": lambda node, inputs: [_variadic(torch.add)(node, inputs)[0] / len(inputs)],
    "Cast": _cast, "CastLike": lambda node, inputs: [as_tensor(inputs[0]).to(as_tensor(inputs[1]).dtype)],
    "Clip": _clip, "Mod": _mod,
    "LeakyRelu": _with_attrs(lambda x, alpha: F.leaky_relu(x, alpha), alpha=0.01),
    "Elu": _with_attrs(lambda x, alpha: F.elu(x, alpha), alpha=1.0),
    "Selu": _with_attrs(_selu, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875),
    "HardSigmoid": _with_attrs(lambda x, alpha, beta: torch.clamp(alpha * x + beta, 0, 1), alpha=0.2, beta=0.5),
    "Flatten": _flatten, "Reshape": _reshape, "Transpose": _transpose, "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze, "Concat": _concat, "Split": _split, "Slice": _slice, "Gather": _gather,
    "GatherElements": _gather_elements, "Expand": _expand, "Tile": _tile, "Pad": _pad,
    "ArgMax": _arg(torch.argmax), "ArgMin": _arg(torch.argmin), "Shape": _shape,
    "Size": lambda node, inputs: [np.array(math.prod(inputs[0].shape), dtype=np.int64)],
    "CumSum": _cumsum, "Trilu": _trilu, "Einsum": lambda node, inputs: [
        torch.einsum(node.attrs["equation"], *[as_tensor(v, inputs) for v in inputs])],
    **NN_OPS,
}  # fmt: skip
