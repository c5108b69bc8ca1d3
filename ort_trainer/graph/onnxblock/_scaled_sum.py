"""``ScaledSum`` (a CUDA/ROCm-only contrib op) back into ``Mul`` + ``Add`` for CPU sessions.

ONNX Runtime 1.19's gradient builder runs ``ScaledSumFusion`` whatever the execution provider: an
``Add`` of two (or three) ``Div``s by scalar constants becomes ``com.microsoft.ScaledSum``, which has
no CPU kernel, so the session fails to start ("Could not find an implementation for ScaledSum").
CLIP's loss ``(ce(logits, arange(n)) + ce(logits.t(), arange(n))) / 2`` gives that pattern (its labels
are traced as constants, so both means divide by a constant), as does any ``a / 2 + b / 2``. The sum
is written out again: ``sum_i input_i * scale_i``, the same values as ``ScaledSum``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

__all__ = ["unfuse_scaled_sum"]

_MS_DOMAIN = "com.microsoft"


def unfuse_scaled_sum(model: onnx.ModelProto) -> int:
    """Replace every ``ScaledSum`` of ``model``'s main graph in place; returns how many were replaced."""
    graph = model.graph
    if not any(n.op_type == "ScaledSum" and n.domain == _MS_DOMAIN for n in graph.node):
        return 0
    cast_like = _opset(model) >= 15
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        if node.op_type != "ScaledSum" or node.domain != _MS_DOMAIN:
            nodes.append(node)
            continue
        nodes.extend(_written_out(node, cast_like))
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def _written_out(node: onnx.NodeProto, cast_like: bool) -> list[onnx.NodeProto]:
    scales = {a.name: a.f for a in node.attribute}
    base = node.name or node.output[0]
    nodes, terms = [], []
    for i, name in enumerate(node.input):
        if not name:
            continue
        scale = f"{base}/scale_{i}"
        nodes.append(
            helper.make_node(
                "Constant",
                [],
                [scale],
                name=scale,
                value=helper.make_tensor(scale, TensorProto.FLOAT, [], [scales[f"scale_{i}"]]),
            )
        )
        if cast_like:  # the scale in the input's type (float16 graphs): no mixed-type Mul
            nodes.append(helper.make_node("CastLike", [scale, name], [f"{scale}/typed"], name=f"{scale}/CastLike"))
            scale = f"{scale}/typed"
        terms.append(f"{base}/term_{i}")
        nodes.append(helper.make_node("Mul", [name, scale], [terms[-1]], name=f"{base}/Mul_{i}"))
    total = terms[0]
    for i, term in enumerate(terms[1:], start=1):
        out = node.output[0] if i == len(terms) - 1 else f"{base}/sum_{i}"
        nodes.append(helper.make_node("Add", [total, term], [out], name=f"{base}/Add_{i}"))
        total = out
    return nodes


def _opset(model: onnx.ModelProto) -> int:
    return next((e.version for e in model.opset_import if e.domain in ("", "ai.onnx")), 1)
