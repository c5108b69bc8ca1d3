"""``SoftmaxCrossEntropyLoss`` -> an explicit log-sum-exp: same loss, ~4x faster forward+backward on CPU.

ONNX Runtime 1.19's CPU ``SoftmaxCrossEntropyLoss`` and its gradient are scalar single-threaded loops
(~36 + 20 ms for 1024 tokens x 8000 classes); ``LogSoftmax`` is fast but ``LogSoftmaxGrad`` is not
(~33 ms). The log-sum-exp written out with element-wise ops (max shift through an integer Cast, so no
gradient flows through it; Exp; ReduceSum; Log) plus a ``GatherElements`` pick of the label's score
takes ~14 ms forward+backward.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._onnx_util import FLOATS, NameMaker, constant, default_opset, int_attr, replace_nodes, str_attr, tensor_types

__all__ = ["decompose_softmax_cross_entropy"]


def decompose_softmax_cross_entropy(model: onnx.ModelProto) -> int:
    """``SoftmaxCrossEntropyLoss(scores, label)`` without class weights -> log-sum-exp + pick + masked mean.

    loss = -sum(mask * logp[label]) / sum(mask) for ``reduction="mean"`` (PyTorch's ``cross_entropy``
    formula; ``mask = label != ignore_index``), the plain masked sum for ``"sum"``, per-element for
    ``"none"``; logp[label] = scores[label] - logsumexp(scores) along axis 1. The optional ``log_prob``
    output is computed (``scores - logsumexp``) only when something reads it.
    """
    graph = model.graph
    opset = default_opset(model)
    if opset < 13 or not any(node.op_type == "SoftmaxCrossEntropyLoss" for node in graph.node):
        return 0
    names = NameMaker(graph, "sce")
    types = tensor_types(model)
    consumed = {o.name for o in graph.output} | {name for node in graph.node for name in node.input}
    changed = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        has_weight = len(node.input) > 2 and node.input[2] != ""
        score_type = types.get(node.input[0], (None, None))[0] if node.op_type == "SoftmaxCrossEntropyLoss" else None
        if node.domain not in ("", "ai.onnx") or has_weight or score_type not in FLOATS:
            new_nodes.append(node)
            continue
        new_nodes.extend(_cross_entropy_nodes(node, names, opset, score_type, consumed))
        changed += 1
    replace_nodes(graph, new_nodes)
    return changed


def _cross_entropy_nodes(
    node: onnx.NodeProto, names: NameMaker, opset: int, score_type: int, consumed: set[str]
) -> list[onnx.NodeProto]:
    scores, label = node.input[0], node.input[1]
    reduction = str_attr(node, "reduction", "mean")
    ignore_index = int_attr(node, "ignore_index", None)
    n = names.new
    nodes: list[onnx.NodeProto] = []
    picked_label, mask = label, None
    if ignore_index is not None:
        ignore = constant(nodes, n("ignore_index"), TensorProto.INT64, [ignore_index])
        zero = constant(nodes, n("zero_label"), TensorProto.INT64, [0])
        is_ignored, mask_bool = n("is_ignored"), n("kept")
        picked_label, mask = n("safe_label"), n("mask")
        nodes += [
            helper.make_node("Equal", [label, ignore], [is_ignored], name=n("Equal")),
            helper.make_node("Not", [is_ignored], [mask_bool], name=n("Not")),
            helper.make_node("Where", [is_ignored, zero, label], [picked_label], name=n("Where")),
            helper.make_node("Cast", [mask_bool], [mask], name=n("Cast"), to=score_type),
        ]
    axis_one = constant(nodes, n("axis1"), TensorProto.INT64, [1])
    label_column, picked = n("label_column"), n("picked")
    nodes.append(helper.make_node("Unsqueeze", [picked_label, axis_one], [label_column], name=n("Unsqueeze")))
    # logp[label] = x[label] - lse, lse = c + log(sum(exp(x - c))) per row; c = max(x) cut to an integer
    # through an int64 Cast, which the gradient builder does not differentiate: any c near the max keeps
    # exp() in range, and the gradient is exp(x - c) / sum = softmax, built from cheap element-wise ops.
    row_max, c_int, c, shifted, exps = n("row_max"), n("c_int"), n("c"), n("shifted"), n("exp")
    exp_sum, log_sum, lse, picked_score, difference = n("exp_sum"), n("log_sum"), n("lse"), n("score"), n("diff")
    if opset >= 18:
        nodes.append(helper.make_node("ReduceMax", [scores, axis_one], [row_max], name=n("ReduceMax"), keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMax", [scores], [row_max], name=n("ReduceMax"), axes=[1], keepdims=1))
    nodes += [
        helper.make_node("Cast", [row_max], [c_int], name=n("CastInt"), to=TensorProto.INT64),
        helper.make_node("Cast", [c_int], [c], name=n("CastBack"), to=score_type),
        helper.make_node("Sub", [scores, c], [shifted], name=n("Shift")),
        helper.make_node("Exp", [shifted], [exps], name=n("Exp")),
        helper.make_node("ReduceSum", [exps, axis_one], [exp_sum], name=n("ReduceSumExp"), keepdims=1),
        helper.make_node("Log", [exp_sum], [log_sum], name=n("Log")),
        helper.make_node("Add", [log_sum, c], [lse], name=n("LogSumExp")),
        helper.make_node("GatherElements", [scores, label_column], [picked_score], name=n("GatherElements"), axis=1),
        helper.make_node("Sub", [picked_score, lse], [difference], name=n("PickedLogProb")),
        helper.make_node("Squeeze", [difference, axis_one], [picked], name=n("Squeeze")),
    ]
    if len(node.output) > 1 and node.output[1] in consumed:  # the optional log_prob output is used
        nodes.append(helper.make_node("Sub", [scores, lse], [node.output[1]], name=n("LogProb")))
    if mask is not None:
        masked = n("masked")
        nodes.append(helper.make_node("Mul", [picked, mask], [masked], name=n("Mul")))
        picked = masked
    loss = node.output[0]
    if reduction == "none":
        nodes.append(helper.make_node("Neg", [picked], [loss], name=n("Neg")))
        return nodes
    total = n("total")
    nodes.append(helper.make_node("ReduceSum", [picked], [total], name=n("ReduceSum"), keepdims=0))
    if reduction == "sum":
        nodes.append(helper.make_node("Neg", [total], [loss], name=n("Neg")))
        return nodes
    if mask is None:
        count = n("count")
        shape, size = n("shape"), n("size")
        nodes += [
            helper.make_node("Shape", [label], [shape], name=n("Shape")),
            helper.make_node("ReduceProd", [shape], [size], name=n("ReduceProd"), keepdims=0),
            helper.make_node("Cast", [size], [count], name=n("CastCount"), to=score_type),
        ]
    else:
        count = n("count")
        nodes.append(helper.make_node("ReduceSum", [mask], [count], name=n("ReduceSumMask"), keepdims=0))
    negative = n("negative_total")
    nodes += [
        helper.make_node("Neg", [total], [negative], name=n("Neg")),
        helper.make_node("Div", [negative, count], [loss], name=n("Div")),
    ]
    return nodes
