"""Tanh-approximated GELU gradients as element-wise ops: same derivative, ~5x faster on CPU.

The gradient builder fuses the tanh approximation of GELU (GPT-2's ``NewGELUActivation``, BLOOM, ...)
into ``FastGelu`` / ``BiasFastGelu`` and differentiates it with ``FastGeluGrad`` /
``BiasFastGeluGrad_dX``. ONNX Runtime 1.19's CPU kernels for those are single-threaded scalar loops:
~35 ms per GPT-2 MLP layer (1024 tokens x 1024), most of a small model's backward pass. This pass,
run on the training graph, writes the derivative with 13 multi-threaded element-wise ops instead:

    gelu(x) = x s,  s = sigmoid(v),  v = 2 k (x + c x^3)       (= 0.5 x (1 + tanh(v / 2)))
    d/dx    = s + x s (1 - s) dv/dx,  dv/dx = 2 k (1 + 3 c x^2),  k = sqrt(2 / pi), c = 0.044715

(``BiasFastGeluGrad_dX`` first adds the bias). The exact (erf) ``GeluGrad`` / ``BiasGeluGrad_dX``
kernels are left alone: they are vectorised and faster than any decomposition (measured: 3.8 vs 10 ms).
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto, helper

from ._onnx_util import NameMaker, replace_nodes, tensor_types

__all__ = ["decompose_gelu_grads"]

_MS = "com.microsoft"
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715
_GRADS = {"FastGeluGrad": False, "BiasFastGeluGrad_dX": True}  # op type -> has a bias input


def decompose_gelu_grads(model: onnx.ModelProto) -> int:
    """Replace the (Bias)FastGeluGrad nodes of a training graph in place; returns how many."""
    if not any(node.op_type in _GRADS and node.domain == _MS for node in model.graph.node):
        return 0
    types = tensor_types(model)
    names = NameMaker(model.graph, "gelu_grad")
    new_nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        has_bias = _GRADS.get(node.op_type) if node.domain == _MS else None
        dtype = types.get(node.input[1], (TensorProto.FLOAT, None))[0] if has_bias is not None else None
        if has_bias is None or dtype != TensorProto.FLOAT:  # the CPU kernels are float-only anyway
            new_nodes.append(node)
            continue
        builder = _Builder(names, new_nodes)
        x = builder.op("Add", node.input[1], node.input[2]) if has_bias else node.input[1]
        slope = _slope(builder, x)
        new_nodes.append(helper.make_node("Mul", [node.input[0], slope], [node.output[0]], name=names.new("dX")))
        changed += 1
    replace_nodes(model.graph, new_nodes)
    return changed


class _Builder:
    """Appends element-wise nodes with fresh names; float constants become scalar ``Constant`` nodes."""

    def __init__(self, names: NameMaker, nodes: list[onnx.NodeProto]):
        self._names, self._nodes = names, nodes

    def const(self, value: float) -> str:
        name = self._names.new("c")
        tensor = helper.make_tensor(name, TensorProto.FLOAT, [], [value])
        self._nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        return name

    def op(self, op_type: str, *inputs: str) -> str:
        out = self._names.new(op_type)
        self._nodes.append(helper.make_node(op_type, list(inputs), [out], name=out))
        return out

    def axpb(self, x: str, a: float, b: float) -> str:
        """a * x + b."""
        return self.op("Add", self.op("Mul", x, self.const(a)), self.const(b))


def _slope(b: _Builder, x: str) -> str:
    """d/dx of x * sigmoid(2 k (x + c x^3)), in 12 ops."""
    x2 = b.op("Mul", x, x)
    m = b.op("Mul", x2, b.const(2 * _K * _C))
    s = b.op("Sigmoid", b.op("Mul", x, b.op("Add", m, b.const(2 * _K))))
    x_dv = b.op("Mul", x, b.axpb(x2, 6 * _K * _C, 2 * _K))  # x dv/dx
    ds = b.op("Sub", s, b.op("Mul", s, s))  # s (1 - s)
    return b.op("Add", s, b.op("Mul", ds, x_dv))
