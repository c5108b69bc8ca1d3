"""``ReluGrad`` as ``dY * Cast(Y > 0)``: the same gradient, 6x faster on ONNX Runtime 1.19's CPU.

The CPU ``ReluGrad`` kernel is a single-threaded Eigen select: 4.7 ms per million elements (two of
them cost 8 ms of the README LM's 220 ms step on one thread), where ``Greater`` + ``Cast`` + ``Mul`` take
0.7 ms. The values are identical wherever the incoming gradient is finite; a non-finite incoming
gradient under an inactive unit gives NaN here and 0 in ``ReluGrad`` (an incoming gradient that is not
finite has already made the rest of the backward pass non-finite, so no step differs in practice).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._onnx_util import NameMaker, replace_nodes, tensor_types

__all__ = ["decompose_relu_grads"]


def decompose_relu_grads(model: onnx.ModelProto) -> int:
    """Replace a training graph's float ``ReluGrad(dY, Y)`` nodes in place; returns how many."""
    if not any(_is_relu_grad(node) for node in model.graph.node):
        return 0
    types = tensor_types(model)
    names = NameMaker(model.graph, "relu_grad")
    new_nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        dtype = types.get(node.input[1], (TensorProto.FLOAT, None))[0] if _is_relu_grad(node) else None
        if dtype != TensorProto.FLOAT:  # not a ReluGrad, or not float (the CPU kernel is float-only anyway)
            new_nodes.append(node)
            continue
        zero, active, mask = names.new("zero"), names.new("active"), names.new("mask")
        new_nodes += [
            helper.make_node("Constant", [], [zero], name=zero, value=helper.make_tensor(zero, dtype, [], [0.0])),
            helper.make_node("Greater", [node.input[1], zero], [active], name=names.new("Greater")),
            helper.make_node("Cast", [active], [mask], name=names.new("Cast"), to=dtype),
            helper.make_node("Mul", [node.input[0], mask], [node.output[0]], name=names.new("dX")),
        ]
        changed += 1
    replace_nodes(model.graph, new_nodes)
    return changed


def _is_relu_grad(node: onnx.NodeProto) -> bool:
    return node.op_type == "ReluGrad" and node.domain == "com.microsoft"
