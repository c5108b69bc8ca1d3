"""Cutting a rank's forward graph at the f/g markers into segments, and building each one's graphs.

Segment ``k`` holds the nodes that come after ``k`` markers on their longest path from the inputs,
so a segment only reads values of earlier segments (its boundary inputs), the user's inputs and
parameters. Each segment gets two ONNX models:

* forward: its nodes, boundary values in, the values later segments (or the user) read out;
* backward: forward + gradient, built by ONNX Runtime's gradient builder from a surrogate loss
  ``sum_o sum(o * o_grad)`` over its float outputs, where each ``o_grad`` (the upstream gradient)
  is an input; it outputs the gradients of its parameters and of its float boundary inputs. The
  forward is recomputed inside the backward model (no activations are kept across the cut except
  the boundary values).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper
from onnxruntime import SessionOptions

from ort_trainer.graph.onnxblock import forget_unnamed_dims
from ort_trainer.runtime import quiet_native_info_logs

from .markers import COPY_OP, DOMAIN, REDUCE_OP

__all__ = ["Marker", "Segment", "SegmentedGraph", "split_graph"]

_SURROGATE = "ort_trainer_parallel_surrogate_loss"
UPSTREAM_SUFFIX = "__upstream_grad"
_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}


@dataclass(frozen=True)
class Marker:
    """A communication point: ``kind`` is COPY_OP (f) or REDUCE_OP (g); ``segment``: the first reader's."""

    kind: str
    input: str
    output: str
    segment: int


@dataclass
class Segment:
    index: int
    forward: onnx.ModelProto
    backward: onnx.ModelProto | None
    inputs: list[str]  # boundary values and user inputs, in graph order
    outputs: list[str]
    params: list[str]  # trainable
    frozen: list[str]
    grad_inputs: list[str] = field(default_factory=list)  # boundary inputs whose gradient the backward gives
    upstream: list[str] = field(default_factory=list)  # outputs that take an upstream gradient


@dataclass
class SegmentedGraph:
    segments: list[Segment]
    markers: list[Marker]
    graph_inputs: list[str]
    graph_outputs: list[str]


def split_graph(forward: onnx.ModelProto, trainable: Sequence[str], frozen: Sequence[str], loss: str) -> SegmentedGraph:
    """Cut ``forward`` (parameters as initializers, markers as custom nodes) into segments with their graphs."""
    model = copy.deepcopy(forward)
    markers = _merge_copy_markers(model)
    if not markers:
        raise ValueError("the sharded model has no communication points: no block of the plan reaches the loss")
    types = _value_types(model, markers)
    graph = model.graph
    params, frozen_set = set(trainable), set(frozen)
    constants = {i.name: i for i in graph.initializer}
    marker_outputs = {n.output[0]: n for n in graph.node if n.domain == DOMAIN}
    seg_of, assigned, consts = {}, {}, {}
    for node in graph.node:
        if node.domain == DOMAIN:
            continue
        if node.op_type == "Constant" and not node.input:
            consts[node.output[0]] = node
            continue
        level = 0
        for name in node.input:
            if name in marker_outputs:
                level = max(level, seg_of.get(marker_outputs[name].input[0], 0) + 1)
            elif name in seg_of:
                level = max(level, seg_of[name])
        for out in node.output:
            seg_of[out] = level
        assigned.setdefault(level, []).append(node)
    _sink_free_nodes(assigned, seg_of, marker_outputs, [o.name for o in graph.output], graph.node)
    found = [
        Marker(n.op_type, n.input[0], n.output[0], seg_of.get(n.input[0], 0) + 1)
        for n in graph.node
        if n.domain == DOMAIN
    ]
    _check_dropout(graph.node, constants, consts)
    graph_inputs = [i.name for i in graph.input if i.name not in constants]
    graph_outputs = [o.name for o in graph.output]
    readers = _readers(assigned, found, graph_outputs, seg_of, marker_outputs)
    trained = _depends_on(graph.node, params, types)
    segments = []
    for index in sorted(assigned):
        segments.append(
            _segment(index, assigned[index], consts, constants, params, frozen_set, types, readers, model, trained)
        )
    return SegmentedGraph(segments, found, graph_inputs, graph_outputs)


def _merge_copy_markers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """One f per replicated value (BERT's Q, K and V read the same hidden state): a single all-reduce."""
    first: dict[str, str] = {}
    rename: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type not in (COPY_OP, REDUCE_OP):
            raise ValueError(f"unknown parallel marker {node.op_type!r}")
        if node.domain == DOMAIN and node.op_type == COPY_OP:
            if node.input[0] in first:
                rename[node.output[0]] = first[node.input[0]]
                continue
            first[node.input[0]] = node.output[0]
        keep.append(node)
    for node in keep:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return [n for n in keep if n.domain == DOMAIN]


def _value_types(model: onnx.ModelProto, markers: Iterable[onnx.NodeProto]) -> dict[str, onnx.ValueInfoProto]:
    """Every value's type, from shape inference on a copy where markers are Identity nodes.

    The declared types of what ONNX cannot infer (outputs of ``com.microsoft`` ops, e.g. the no-gradient
    copies of ``graph.onnxblock._no_gradient``) are kept, so that inference goes on past them; the rest are
    inferred anew.
    """
    probe = copy.deepcopy(model)
    for node in probe.graph.node:
        if node.domain == DOMAIN:
            node.domain, node.op_type = "", "Identity"
    opaque = {o for node in probe.graph.node if node.domain not in ("", "ai.onnx") for o in node.output}
    declared = [info for info in probe.graph.value_info if info.name in opaque]
    del probe.graph.value_info[:]
    probe.graph.value_info.extend(declared)
    inferred = forget_unnamed_dims(onnx.shape_inference.infer_shapes(probe))
    g = inferred.graph
    types = {v.name: v for v in [*g.value_info, *g.input, *g.output]}
    for init in g.initializer:
        types.setdefault(init.name, helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return types


def _check_dropout(nodes, constants, consts) -> None:
    """Refuse dropout that is on: the backward graph recomputes the forward, which would draw another mask."""
    for node in nodes:
        if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
            continue  # no training_mode input: inference, identity
        ratio = 0.5  # ONNX default
        if len(node.input) > 1 and node.input[1]:
            tensor = constants.get(node.input[1])
            if tensor is None and node.input[1] in consts:
                tensor = consts[node.input[1]].attribute[0].t
            ratio = float(onnx.numpy_helper.to_array(tensor)) if tensor is not None else None
        if ratio != 0.0:
            raise ValueError(
                f"dropout node {node.name!r} has a non-zero (or unknown) ratio: horizontal parallel training "
                "recomputes each segment's forward in its backward, which would draw a different mask; set "
                "the model's dropout probabilities to 0"
            )


def _readers(assigned, markers, graph_outputs, seg_of, marker_outputs) -> dict[str, set[int]]:
    """{value: segments that read it} (-1: the user / a marker reads it after its segment)."""
    readers: dict[str, set[int]] = {}
    for level, nodes in assigned.items():
        for node in nodes:
            for name in node.input:
                if name and name not in marker_outputs:
                    readers.setdefault(name, set()).add(level)
    for m in markers:
        readers.setdefault(m.input, set()).add(-1)
    for name in graph_outputs:
        readers.setdefault(name, set()).add(-1)
    return readers


def _depends_on(nodes, params: set[str], types) -> set[str]:
    """Float values that depend on a trainable parameter: the only ones a gradient flows through (masks,
    shapes and values computed from shapes do not)."""
    found = set(params)
    for node in nodes:
        if any(name in found for name in node.input):
            found.update(o for o in node.output if o in types and _is_float(types[o]))
    return found


def _sink_free_nodes(assigned, seg_of, marker_outputs, graph_outputs, nodes) -> None:
    """Move nodes that read no marker (weight transposes, mask arithmetic) into the first segment that reads
    them, instead of segment 0: fewer values cross the cuts."""
    free = {id(n) for n in assigned.get(0, [])}
    marker_inputs = {m.input[0] for m in marker_outputs.values()}
    consumers: dict[str, list[int]] = {}
    for level, group in assigned.items():
        for node in group:
            for name in node.input:
                consumers.setdefault(name, []).append(level)
    pinned = marker_inputs | set(graph_outputs)
    for node in reversed(list(nodes)):
        if id(node) not in free or any(o in pinned for o in node.output):
            continue
        levels = [lvl for o in node.output for lvl in consumers.get(o, [])]
        target = min(levels) if levels else 0
        if target > 0:
            assigned[0].remove(node)
            assigned.setdefault(target, []).append(node)
            for o in node.output:
                seg_of[o] = target
            for name in node.input:
                consumers.setdefault(name, []).append(target)
    for level in assigned:  # keep topological order inside each segment
        order = {id(n): i for i, n in enumerate(nodes)}
        assigned[level].sort(key=lambda n: order[id(n)])


def _segment(index, nodes, consts, constants, params, frozen, types, readers, model, trained) -> Segment:
    produced = {out for node in nodes for out in node.output}
    read = []
    for node in nodes:
        for name in node.input:
            if name and name not in produced and name not in read:
                read.append(name)
    used_consts = [consts[n] for n in read if n in consts]
    read = [n for n in read if n not in consts]
    seg_params = [n for n in read if n in params]
    seg_frozen = [n for n in read if n in frozen]
    inits = [constants[n] for n in read if n in constants and n not in params and n not in frozen]
    inputs = [n for n in read if n not in constants]
    outputs = [n for n in _ordered(produced, nodes) if readers.get(n, set()) - {index}]
    for name in (*inputs, *outputs):
        if name not in types or not types[name].type.tensor_type.elem_type:
            raise ValueError(f"segment {index}: the type of value {name!r} is unknown")
    graph = helper.make_graph(
        [*used_consts, *nodes],
        f"segment_{index}",
        [types[n] for n in (*inputs, *seg_params, *seg_frozen)],
        [types[n] for n in outputs],
        initializer=inits,
        value_info=[types[n] for n in produced if n in types and n not in outputs],
    )
    opsets = [o for o in model.opset_import if o.domain != DOMAIN]
    forward = helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    grad_inputs = [n for n in inputs if _is_float(types[n]) and n in trained]
    upstream = [n for n in outputs if _is_float(types[n]) and n in trained]
    segment = Segment(index, forward, None, inputs, outputs, seg_params, seg_frozen, grad_inputs, upstream)
    if upstream and (seg_params or grad_inputs):
        segment.backward, segment.grad_inputs = _backward(forward, types, upstream, seg_params, grad_inputs)
    return segment


def _ordered(produced: set[str], nodes) -> list[str]:
    return [out for node in nodes for out in node.output if out in produced and out]


def _is_float(info: onnx.ValueInfoProto) -> bool:
    return info.type.tensor_type.elem_type in _FLOATS


def _backward(forward, types, upstream, params, grad_inputs):
    """Forward + gradient of ``sum_o sum(o * upstream_o)`` w.r.t. ``params`` and ``grad_inputs``."""
    model = copy.deepcopy(forward)
    graph = model.graph
    terms = []
    for i, name in enumerate(upstream):
        info = copy.deepcopy(types[name])
        info.name = name + UPSTREAM_SUFFIX
        graph.input.append(info)
        graph.node.append(helper.make_node("Mul", [name, info.name], [f"{_SURROGATE}_mul{i}"]))
        graph.node.append(helper.make_node("ReduceSum", [f"{_SURROGATE}_mul{i}"], [f"{_SURROGATE}_sum{i}"], keepdims=0))
        terms.append(f"{_SURROGATE}_sum{i}")
    total = terms[0]
    for i, term in enumerate(terms[1:]):
        graph.node.append(helper.make_node("Add", [total, term], [f"{_SURROGATE}_add{i}"]))
        total = f"{_SURROGATE}_add{i}"
    graph.node.append(helper.make_node("Identity", [total], [_SURROGATE]))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(_SURROGATE, TensorProto.FLOAT, []))
    wanted = set(params) | set(grad_inputs)
    options = SessionOptions()
    with quiet_native_info_logs():
        # onnxruntime-training's gradient builder: imported here, so that the package imports on stock onnxruntime
        from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

        optimized = get_optimized_model(model.SerializeToString(), wanted, options)
        builder = GradientGraphBuilder(optimized, {_SURROGATE}, wanted, _SURROGATE, options)
        builder.build()
        result = onnx.load_from_string(builder.get_model())
    have = {o.name for o in result.graph.output}
    kept = [n for n in grad_inputs if f"{n}_grad" in have]
    missing = [n for n in params if f"{n}_grad" not in have]
    if missing:
        raise ValueError(f"no gradient for parameters {missing} in their segment")
    return result, kept
