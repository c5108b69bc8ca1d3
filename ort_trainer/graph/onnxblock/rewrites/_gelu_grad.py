"""GELU gradients as element-wise ops: the same derivative, 1.5-15x faster than ORT 1.19's CPU kernels.

The gradient builder fuses GELU into ``Gelu`` / ``BiasGelu`` (exact, erf: BERT) or ``FastGelu`` /
``BiasFastGelu`` (tanh approximation: GPT-2's ``NewGELUActivation``) and differentiates them with
``GeluGrad``, ``BiasGeluGrad_dX``, ``FastGeluGrad``, ``BiasFastGeluGrad_dX``. On CPU those are
single-threaded Eigen loops; the tanh ones are scalar: ~35 ms per GPT-2 MLP layer (1024 tokens x 1024)
where the 12 multi-threaded element-wise ops below take ~2.5 ms; the exact ones ~3.5 ms per million
elements where the element-wise form takes ~2.1 ms (measured, 2 cores). This pass, run on the
training graph, writes (after adding the bias, for the ``Bias*`` variants):

* exact: d/dx gelu(x) = Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
* tanh:  gelu(x) = x s, s = sigmoid(v), v = 2 k (x + c x^3)  (= 0.5 x (1 + tanh(v / 2)));
         d/dx = s + x s (1 - s) dv/dx, dv/dx = 2 k (1 + 3 c x^2), k = sqrt(2 / pi), c = 0.044715

Both are the functions PyTorch differentiates (tests/onnxblock/test_graph_gelu.py).
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
_GRADS = {  # op type -> (tanh approximation, has a bias input)
    "GeluGrad": (False, False),
    "BiasGeluGrad_dX": (False, True),
    "FastGeluGrad": (True, False),
    "BiasFastGeluGrad_dX": (True, True),
}


def decompose_gelu_grads(model: onnx.ModelProto, exact: bool = True) -> int:
    """Replace the (Bias)(Fast)GeluGrad nodes of a training graph in place; returns how many.

    ``exact=False`` leaves the exact (erf) ones to ORT's kernels: on ONE thread ``BiasGeluGrad_dX`` is
    faster than its 12 element-wise ops (9.7 vs 14.9 ms for 2048 x 1024, CPU time); the element-wise
    form wins only when ORT runs them on several threads. The tanh ones are faster decomposed even on
    one thread (41 -> 20 ms for 2048 x 1024).
    """
    if not any(node.op_type in _GRADS and node.domain == _MS for node in model.graph.node):
        return 0
    types = tensor_types(model)
    names = NameMaker(model.graph, "gelu_grad")
    new_nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        kind = _GRADS.get(node.op_type) if node.domain == _MS else None
        kind = None if kind is not None and not kind[0] and not exact else kind
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
    """Phi(x) + x phi(x), in 11 ops."""
    scaled = b.op("Mul", x, b.const(1.0 / math.sqrt(2.0)))  # x / sqrt 2
    cdf = b.axpb(b.op("Erf", scaled), 0.5, 0.5)
    density = b.op("Exp", b.op("Mul", scaled, b.op("Mul", x, b.const(-1.0 / math.sqrt(2.0)))))  # exp(-x^2 / 2)
    return b.op("Add", cdf, b.op("Mul", b.op("Mul", x, density), b.const(1.0 / math.sqrt(2.0 * math.pi))))


def _tanh_slope(b: _Builder, x: str) -> str:
    """d/dx of x * sigmoid(2 k (x + c x^3)), in 11 ops."""
    x2 = b.op("Mul", x, x)
    m = b.op("Mul", x2, b.const(2 * _K * _C))
    s = b.op("Sigmoid", b.op("Mul", x, b.op("Add", m, b.const(2 * _K))))
    x_dv = b.op("Mul", x, b.axpb(x2, 6 * _K * _C, 2 * _K))  # x dv/dx
    ds = b.op("Sub", s, b.op("Mul", s, s))  # s (1 - s)
    return b.op("Add", s, b.op("Mul", ds, x_dv))
