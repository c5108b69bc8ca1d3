"""``cross_entropy(..., label_smoothing=e)``, which the TorchScript exporter refuses: torch's formula in ONNX ops.

torch (``cross_entropy_loss_label_smoothing``): ``(1 - e) * nll + e / C * smooth``, where ``nll`` is the plain
loss (``SoftmaxCrossEntropyLoss``: weights, ``ignore_index`` and reduction as given) and ``smooth`` the sum over
classes of ``-log_softmax * weight``, zero where the label is ``ignore_index``, reduced like ``nll``: summed, or for
"mean" divided by the number of counted labels (without weights) or the sum of their weights (with). ONNX
Runtime differentiates every op of it (``LogSoftmax``, ``ReduceSum``, ``Where``), so the gradient is torch's.
Class-probability targets keep torch's symbolic (and its error).
"""

from __future__ import annotations

import torch
from torch.onnx import symbolic_helper as sh

from ._no_gradient import active

__all__ = ["cross_entropy_symbolic"]

_REDUCTIONS = ("none", "mean", "sum")


def cross_entropy_symbolic(torch_symbolic):
    """The ``aten::cross_entropy_loss`` symbolic registered by `_symbolics`: smoothing ours, the rest torch's."""

    def cross_entropy_loss(g, scores, target, weight, reduction, ignore_index, label_smoothing):
        smoothing = sh._maybe_get_const(label_smoothing, "f")
        integer_target = target.type().kind() == "TensorType" and target.type().scalarType() in ("Long", "Int")
        if not (active() and integer_target and isinstance(smoothing, float) and smoothing > 0.0):
            return torch_symbolic(g, scores, target, weight, reduction, ignore_index, label_smoothing)
        return _smoothed(
            g,
            scores,
            target,
            None if sh._is_none(weight) else weight,
            _REDUCTIONS[sh._maybe_get_const(reduction, "i")],
            sh._maybe_get_const(ignore_index, "i"),
            smoothing,
        )

    return cross_entropy_loss


def _smoothed(g, scores, target, weight, reduction: str, ignore_index: int, smoothing: float):
    dtype = scores.type().dtype() if scores.type().scalarType() else torch.float32

    def scalar(value):
        return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))

    def ints(*values: int):
        return g.op("Constant", value_t=torch.tensor(list(values), dtype=torch.int64))

    weighted = (weight,) if weight is not None else ()
    nll = g.op("SoftmaxCrossEntropyLoss", scores, target, *weighted, reduction_s=reduction, ignore_index_i=ignore_index)
    log_prob = g.op("LogSoftmax", scores, axis_i=1)
    if weight is not None:
        rank = sh._get_tensor_rank(scores)
        if rank is None:
            raise torch.onnx.errors.SymbolicValueError("cross_entropy: the scores' rank must be known", scores)
        shape = [1, -1] + [1] * (rank - 2)  # (C,) -> (1, C, 1, ...): broadcast over the class axis
        log_prob = g.op("Mul", log_prob, g.op("Reshape", weight, ints(*shape)))
    smooth = g.op("Neg", g.op("ReduceSum", log_prob, ints(1), keepdims_i=0))
    ignored = g.op("Equal", target, g.op("Constant", value_t=torch.tensor(ignore_index, dtype=torch.int64)))
    smooth = g.op("Where", ignored, scalar(0.0), smooth)
    if reduction == "sum":
        smooth = g.op("ReduceSum", smooth, keepdims_i=0)
    elif reduction == "mean":
        if weight is not None:
            picked = g.op("Gather", weight, g.op("Where", ignored, ints(0), target))
            counted = g.op("ReduceSum", g.op("Where", ignored, scalar(0.0), picked), keepdims_i=0)
        else:
            counted = g.op("ReduceSum", g.op("Cast", g.op("Not", ignored), to_i=_onnx_float(dtype)), keepdims_i=0)
        smooth = g.op("Div", g.op("ReduceSum", smooth, keepdims_i=0), counted)
    classes = g.op("Gather", g.op("Shape", scores), g.op("Constant", value_t=torch.tensor(1)))
    classes = g.op("Cast", classes, to_i=_onnx_float(dtype))
    return g.op(
        "Add", g.op("Mul", nll, scalar(1.0 - smoothing)), g.op("Mul", smooth, g.op("Div", scalar(smoothing), classes))
    )


def _onnx_float(dtype: torch.dtype) -> int:
    return {torch.float16: 10, torch.bfloat16: 16, torch.float64: 11}.get(dtype, 1)
