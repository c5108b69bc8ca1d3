"""``LayerNormalizationGrad`` as element-wise ops and reductions: the same gradients, ~2x faster on CPU.

ONNX Runtime 1.19's CPU ``LayerNormalizationGrad`` kernel is a single-threaded Eigen loop: 2.0 ms for
1024 x 256 (HF GPT-2 small: 9 of them per step, ~4% of a 1-thread step), 1.5 ms for 256 x 768, 5.5 ms
for 2048 x 256 (BERT small). Written out with the formulas below, ORT's vectorised (and multi-threaded)
element-wise kernels take 1.2, 0.6 and 2.8 ms (measured at 1 thread by CPU time; results equal to the
kernel's to ~1e-6 relative). With x^ = (x - mean) * inv_std over the last axis, g the scale:

    dX     = inv_std * (g dY - mean(g dY) - x^ mean(g dY x^))      (means over the normalized axis)
    dscale = sum(dY x^),  dbias = sum(dY)                           (sums over every other axis)

Only the common case is rewritten: float32, normalization over the last axis, known rank.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._onnx_util import NameMaker, constant, default_opset, int_attr, replace_nodes, tensor_types

__all__ = ["decompose_layer_norm_grads"]

_MS = "com.microsoft"


def decompose_layer_norm_grads(model: onnx.ModelProto) -> int:
    """Replace the ``LayerNormalizationGrad`` nodes of a training graph in place; returns how many."""
    if not any(node.op_type == "LayerNormalizationGrad" and node.domain == _MS for node in model.graph.node):
        return 0
    types = tensor_types(model)
    names = NameMaker(model.graph, "ln_grad")
    opset = default_opset(model)
    new_nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        rank = _rewritable_rank(node, types)
        if rank is None:
            new_nodes.append(node)
            continue
        new_nodes.extend(_grad_nodes(node, rank, opset, names))
        changed += 1
    replace_nodes(model.graph, new_nodes)
    return changed


def _rewritable_rank(node: onnx.NodeProto, types: dict) -> int | None:
    """The rank of X when ``node`` is a float32 last-axis LayerNormalizationGrad with 5 inputs, else None."""
    if node.op_type != "LayerNormalizationGrad" or node.domain != _MS or len(node.input) != 5:
        return None
    dtype, rank = types.get(node.input[1], (None, None))
    axis = int_attr(node, "axis", -1)
    if dtype != TensorProto.FLOAT or not rank or rank < 2 or axis not in (-1, rank - 1):
        return None
    if any(types.get(name, (TensorProto.FLOAT, None))[0] != TensorProto.FLOAT for name in node.input[2:]):
        return None
    return rank


def _grad_nodes(node: onnx.NodeProto, rank: int, opset: int, names: NameMaker) -> list[onnx.NodeProto]:
    dy, x, scale, mean, inv_std = node.input
    outputs = list(node.output) + [""] * (3 - len(node.output))
    nodes: list[onnx.NodeProto] = []

    def op(op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or names.new(op_type)
        nodes.append(helper.make_node(op_type, list(inputs), [out], name=names.new(op_type), **attrs))
        return out

    def row_mean(value: str) -> str:  # mean over the last axis, kept for broadcasting
        if opset >= 18:
            return op("ReduceMean", value, constant(nodes, names.new("last_axis"), TensorProto.INT64, [-1]))
        return op("ReduceMean", value, axes=[-1], keepdims=1)

    def column_sum(value: str, out: str) -> None:  # sum over every axis but the last: the scale's shape
        leading = list(range(rank - 1))
        if opset < 13:
            op("ReduceSum", value, out=out, axes=leading, keepdims=0)
            return
        op(
            "ReduceSum",
            value,
            constant(nodes, names.new("leading_axes"), TensorProto.INT64, leading),
            out=out,
            keepdims=0,
        )

    x_hat = op("Mul", op("Sub", x, mean), inv_std)
    if outputs[0]:
        g_dy = op("Mul", dy, scale)
        centred = op("Sub", g_dy, row_mean(g_dy))
        projection = op("Mul", x_hat, row_mean(op("Mul", g_dy, x_hat)))
        op("Mul", op("Sub", centred, projection), inv_std, out=outputs[0])
    if outputs[1]:
        column_sum(op("Mul", dy, x_hat), outputs[1])
    if outputs[2]:
        column_sum(dy, outputs[2])
    return nodes
