"""Speed rewrites of the forward graph, run before gradient building; the math stays the same.

Two CPU training kernels of ONNX Runtime 1.19 dominate a small transformer LM step besides the
GEMMs (`benchmarks/profile_step.py`: vocab 8000, 1024 tokens, 2 threads, ~114 of ~271 kernel ms):

* ``GatherGrad`` takes a mutex for every gradient element it adds (no sort: a lock per float),
  ~8 ms per node with two threads. It is the gradient of the embedding ``Gather`` and, six times in
  a 2-layer encoder, of the q/k/v split (``proj[0]``, ``proj[1]``, ``proj[2]``) of
  ``nn.MultiheadAttention``'s packed in-projection. ``GatherND`` with the indices unsqueezed computes
  the same values; its gradient ``GatherNDGrad`` is a plain loop: ~0.7 ms per node.
* ``SoftmaxCrossEntropyLoss`` and its gradient are scalar single-threaded loops (~36 + 20 ms);
  ``LogSoftmax`` is fast but ``LogSoftmaxGrad`` is not (~33 ms). The log-sum-exp written out with
  element-wise ops (max shift through an integer Cast, so no gradient flows through it; Exp;
  ReduceSum; Log) plus a ``GatherElements`` pick of the label's score takes ~14 ms forward+backward.

`apply_rewrites` is a pure function of the forward graph: same inputs and outputs (names, shapes,
values to float rounding), gradients equal PyTorch's to ~1e-6 relative (tests/test_graph_rewrites.py).
The rewrites target the CPU kernels; CUDA has sort-based GatherGrad and fused loss kernels.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

__all__ = ["apply_rewrites", "gather_to_gather_nd", "decompose_softmax_cross_entropy"]

_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


def apply_rewrites(model: onnx.ModelProto) -> int:
    """Apply every rewrite below in place; returns the number of nodes replaced."""
    return gather_to_gather_nd(model) + decompose_softmax_cross_entropy(model)


def gather_to_gather_nd(model: onnx.ModelProto) -> int:
    """``Gather(data, idx, axis=0)`` of float ``data`` -> ``GatherND(data, Unsqueeze(idx, -1))``.

    Same output (``idx.shape + data.shape[1:]``, scalar ``idx`` included); the gradient becomes
    ``GatherNDGrad`` instead of the mutex-per-element ``GatherGrad``. Covers embeddings (``data`` an
    initializer) and the q/k/v split of a packed attention projection (``proj[0]``, ``proj[1]``...).
    """
    graph = model.graph
    types = _tensor_types(model)
    names = _NameMaker(graph, "gather_nd")
    opset = _default_opset(model)
    changed = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        data_type, rank = types.get(node.input[0], (None, None)) if node.op_type == "Gather" else (None, None)
        axis = _int_attr(node, "axis", 0)
        if (
            node.domain not in ("", "ai.onnx")
            or data_type not in _FLOATS
            or not (axis == 0 or (rank is not None and axis == -rank))
        ):
            new_nodes.append(node)
            continue
        indices = node.input[1]
        if types.get(indices, (None, None))[0] != TensorProto.INT64:  # GatherND takes int64 indices only
            cast = names.new(f"{indices}_int64")
            new_nodes.append(helper.make_node("Cast", [indices], [cast], name=names.new("Cast"), to=TensorProto.INT64))
            indices = cast
        unsqueezed = names.new(f"{indices}_unsqueezed")
        _unsqueeze(indices, unsqueezed, -1, opset, names, new_nodes)
        new_nodes.append(
            helper.make_node(
                "GatherND", [node.input[0], unsqueezed], list(node.output), name=node.name or names.new("GatherND")
            )
        )
        changed += 1
    _replace_nodes(graph, new_nodes)
    return changed


def decompose_softmax_cross_entropy(model: onnx.ModelProto) -> int:
    """``SoftmaxCrossEntropyLoss(scores, label)`` without class weights -> log-sum-exp + pick + masked mean.

    loss = -sum(mask * logp[label]) / sum(mask) for ``reduction="mean"`` (PyTorch's ``cross_entropy``
    formula; ``mask = label != ignore_index``), the plain masked sum for ``"sum"``, per-element for
    ``"none"``; logp[label] = scores[label] - logsumexp(scores) along axis 1. The optional ``log_prob``
    output is computed (``scores - logsumexp``) only when something reads it.
    """
    graph = model.graph
    opset = _default_opset(model)
    if opset < 13 or not any(node.op_type == "SoftmaxCrossEntropyLoss" for node in graph.node):
        return 0
    names = _NameMaker(graph, "sce")
    types = _tensor_types(model)
    consumed = {o.name for o in graph.output} | {name for node in graph.node for name in node.input}
    changed = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        has_weight = len(node.input) > 2 and node.input[2] != ""
        score_type = types.get(node.input[0], (None, None))[0] if node.op_type == "SoftmaxCrossEntropyLoss" else None
        if node.domain not in ("", "ai.onnx") or has_weight or score_type not in _FLOATS:
            new_nodes.append(node)
            continue
        new_nodes.extend(_cross_entropy_nodes(node, names, opset, score_type, consumed))
        changed += 1
    _replace_nodes(graph, new_nodes)
    return changed


def _cross_entropy_nodes(
    node: onnx.NodeProto, names: _NameMaker, opset: int, score_type: int, consumed: set[str]
) -> list[onnx.NodeProto]:
    scores, label = node.input[0], node.input[1]
    reduction = _str_attr(node, "reduction", "mean")
    ignore_index = _int_attr(node, "ignore_index", None)
    n = names.new
    nodes: list[onnx.NodeProto] = []
    picked_label, mask = label, None
    if ignore_index is not None:
        ignore = _constant(nodes, n("ignore_index"), TensorProto.INT64, [ignore_index])
        zero = _constant(nodes, n("zero_label"), TensorProto.INT64, [0])
        is_ignored, mask_bool = n("is_ignored"), n("kept")
        picked_label, mask = n("safe_label"), n("mask")
        nodes += [
            helper.make_node("Equal", [label, ignore], [is_ignored], name=n("Equal")),
            helper.make_node("Not", [is_ignored], [mask_bool], name=n("Not")),
            helper.make_node("Where", [is_ignored, zero, label], [picked_label], name=n("Where")),
            helper.make_node("Cast", [mask_bool], [mask], name=n("Cast"), to=score_type),
        ]
    axis_one = _constant(nodes, n("axis1"), TensorProto.INT64, [1])
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


# ---------------------------------------------------------------------------------------------- helpers
class _NameMaker:
    """Fresh tensor/node names that clash with nothing in the graph."""

    def __init__(self, graph: onnx.GraphProto, prefix: str):
        self._taken = {init.name for init in graph.initializer} | {i.name for i in graph.input}
        for node in graph.node:
            self._taken.update(node.output)
            self._taken.add(node.name)
        self._prefix = prefix

    def new(self, hint: str) -> str:
        base = f"{self._prefix}/{hint.strip('/')}"
        name, i = base, 0
        while name in self._taken:
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        return name


def _tensor_types(model: onnx.ModelProto) -> dict[str, tuple[int, int | None]]:
    """Element type and rank (None if unknown) of every tensor ONNX shape inference can type."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - e.g. a >2 GB model: fall back to what the graph declares
        inferred = model.graph
    types: dict[str, tuple[int, int | None]] = {}
    for init in inferred.initializer:
        types[init.name] = (init.data_type, len(init.dims))
    for node in inferred.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            tensor = node.attribute[0].t
            types[node.output[0]] = (tensor.data_type, len(tensor.dims))
    for info in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
        tensor_type = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tensor_type is not None and tensor_type.elem_type:
            rank = len(tensor_type.shape.dim) if tensor_type.HasField("shape") else None
            types[info.name] = (tensor_type.elem_type, rank)
    return types


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def _int_attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return int(attr.i)
    return default


def _str_attr(node: onnx.NodeProto, name: str, default: str) -> str:
    for attr in node.attribute:
        if attr.name == name:
            return attr.s.decode()
    return default


def _constant(nodes: list[onnx.NodeProto], name: str, dtype: int, values: list) -> str:
    """A ``Constant`` node (not an initializer: those would look like parameters to the trainer)."""
    nodes.append(
        helper.make_node(
            "Constant", [], [name], name=name, value=helper.make_tensor(name, dtype, [len(values)], values)
        )
    )
    return name


def _unsqueeze(source: str, target: str, axis: int, opset: int, names: _NameMaker, nodes: list) -> None:
    if opset >= 13:
        axes = _constant(nodes, names.new("unsqueeze_axes"), TensorProto.INT64, [axis])
        nodes.append(helper.make_node("Unsqueeze", [source, axes], [target], name=names.new("Unsqueeze")))
    else:
        nodes.append(helper.make_node("Unsqueeze", [source], [target], name=names.new("Unsqueeze"), axes=[axis]))


def _replace_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    kept = list(nodes)
    del graph.node[:]
    graph.node.extend(kept)
