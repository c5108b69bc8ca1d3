"""GELU gradients as element-wise ops: the same derivative, ~10x faster than ORT 1.19's CPU kernels.

The gradient builder fuses GELU into ``Gelu``/``BiasGelu`` (exact, erf) or ``FastGelu`` (tanh
approximation, GPT-2's ``NewGELUActivation``) and differentiates them with ``GeluGrad``,
``BiasGeluGrad_dX``, ``FastGeluGrad`` and ``BiasFastGeluGrad_dX``. On CPU those are single-threaded Eigen
loops: ~50 ms per GPT-2 MLP layer (1024 tokens x 1024) where a multi-threaded element-wise op takes
~0.3 ms. This pass, run on the training graph, replaces each with ~10-15 ONNX element-wise ops:

* exact:  d/dx gelu(x) = Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
* tanh:   with u = k (x + c x^3), t = tanh(u), k = sqrt(2 / pi), c = 0.044715:
          d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)

(the ``Bias*`` variants take ``x + bias`` first). Both are the formulas PyTorch differentiates.
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
_GRADS = {"GeluGrad": (False, False), "BiasGeluGrad_dX": (False, True), "FastGeluGrad": (True, False)}
_GRADS["BiasFastGeluGrad_dX"] = (True, True)  # op type -> (tanh approximation, has bias)


def decompose_gelu_grads(model: onnx.ModelProto) -> int:
    """Replace the (Bias)(Fast)GeluGrad nodes of a training graph in place; returns how many."""
    if not any(node.op_type in _GRADS and node.domain == _MS for node in model.graph.node):
        return 0
    types = tensor_types(model)
    names = NameMaker(model.graph, "gelu_grad")
    new_nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        kind = _GRADS.get(node.op_type) if node.domain == _MS else None
        dtype = types.get(node.input[1], (TensorProto.FLOAT, None))[0] if kind else None
        if kind is None or dtype != TensorProto.FLOAT:  # the CPU kernels are float-only anyway
            new_nodes.append(node)
            continue
        tanh, has_bias = kind
        builder = _Builder(names, new_nodes)
        x = builder.op("Add", node.input[1], node.input[2]) if has_bias else node.input[1]
        slope = _tanh_slope(builder, x) if tanh else _erf_slope(builder, x)
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


def _erf_slope(b: _Builder, x: str) -> str:
    cdf = b.axpb(b.op("Erf", b.op("Mul", x, b.const(1.0 / math.sqrt(2.0)))), 0.5, 0.5)
    density = b.op("Exp", b.op("Mul", b.op("Mul", x, x), b.const(-0.5)))
    return b.op("Add", cdf, b.op("Mul", b.op("Mul", x, density), b.const(1.0 / math.sqrt(2.0 * math.pi))))


def _tanh_slope(b: _Builder, x: str) -> str:
    x2 = b.op("Mul", x, x)
    t = b.op("Tanh", b.op("Mul", x, b.axpb(x2, _K * _C, _K)))  # tanh(k (x + c x^3))
    half_dinner = b.axpb(x2, 1.5 * _K * _C, 0.5 * _K)  # 0.5 k (1 + 3 c x^2)
    one_minus_t2 = b.op("Sub", b.const(1.0), b.op("Mul", t, t))
    return b.op("Add", b.axpb(t, 0.5, 0.5), b.op("Mul", b.op("Mul", x, one_minus_t2), half_dinner))
