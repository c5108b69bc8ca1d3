"""Mixed precision on the forward graph, before the gradient graph is built.

Design: fp32 master weights stay the trainable graph inputs; ``Cast(w -> fp16)`` is inserted in the
graph where float16 nodes consume them. ONNX Runtime's gradient builder then differentiates through
that Cast (its gradient is a Cast back to float32), so ``w``'s gradient arrives in float32 and is
accumulated by ``InPlaceAccumulatorV2`` into the existing flat fp32 gradient buffer.

Why not fp16 twin inputs (``w_fp16``, refreshed by the trainer after each update), the legacy shape?
Measured with onnxblock in onnxruntime-training 1.19.2: the gradient buffer onnxblock creates for a
float16 trainable input is float16 (``w_fp16_grad.accumulation.buffer``), so (1) gradients would be
summed over accumulation micro-steps in float16 (precision loss and overflow, with the loss scale on
top), in a second, fp16 flat buffer that the optimizer cannot use directly; and (2) on the CPU EP,
which has no float16 ``InPlaceAccumulatorV2``, ORT wraps the accumulator in inserted Casts, so the
"in-place" sum goes into a temporary copy and the bound buffer silently stays zero. The in-graph
Cast is the fp16 copy: it is recomputed from the master weights at the start of every step, which is
exactly "the fp16 copy refreshed after each update", with nothing for the trainer to refresh or bind.
Cost: one cast of each weight per step (a bandwidth-bound pass, small next to the step), no extra
persistent buffer.

Which nodes run in float16 is decided from what the provider supports (`provider_fp16_support`):
* compute nodes (arithmetic) run in fp16 when their op has a float16 kernel on the provider;
* data-movement nodes (Reshape, Transpose, Gather, Slice, Concat, Shape...), constants and casts into
  float follow their neighbours: fp16 if a float input already is fp16, or if every consumer is fp16.
  Moving values between two float32 kernels through float16 would only add rounding and casts;
* the loss tail (the nodes between the last node that reads a parameter and the loss: the loss op,
  reductions, log-softmax...) stays float32. A loss is a sum/mean over the batch; in fp16 it loses
  precision (N rounding steps) and can overflow (a sum of squares past 65504), and the scaled loss
  (loss x 65536 overflows fp16 for any loss >= 1) must be float32. This costs one logits-sized op.
Graph inputs and outputs keep their declared types (Casts at the edges); integer/bool tensors are
never touched; float16 nodes whose type comes from an attribute get it rewritten (Constant values,
ConstantOfShape value, Cast ``to``, Random*/EyeLike ``dtype``).

Loss scaling: a float32 scalar input `LOSS_SCALE_INPUT` and ``Mul(loss, loss_scale)`` producing
``<loss>_scaled``, the output to backprop from; the user-visible loss output stays unscaled.

Trainer, per step: feed ``loss_scale`` (0-d float32, the scaler's scale, fixed within an accumulation
cycle) like a user input; the fp32 grad buffer then holds scale x gradients. Before the update, one
pass over the flat buffer checks all-finite and unscales it; skip the update if any is non-finite.
The eval graph gets `strip_loss_scaling`. Nothing else to bind or refresh.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._fp16_support import fp16_type_params, schema_for

__all__ = ["LOSS_SCALE_INPUT", "MixedPrecisionGraph", "convert_to_mixed_precision", "strip_loss_scaling"]

LOSS_SCALE_INPUT = "loss_scale"
_F32, _F16 = TensorProto.FLOAT, TensorProto.FLOAT16
_FP16_MAX = float(np.finfo(np.float16).max)
# Ops whose float outputs are input values moved around (no arithmetic): they follow their neighbours.
_MOVEMENT = {
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "GatherElements", "GatherND", "Slice",
    "Concat", "Split", "Expand", "Tile", "Identity", "Pad", "Where", "Compress", "ReverseSequence", "ScatterND",
    "ScatterElements", "DepthToSpace", "SpaceToDepth", "Shape", "Size", "Cast", "CastLike",
}  # fmt: skip
_FOLLOWS_FP32 = "data movement / constant next to float32 neighbours"
_DTYPE_ATTRIBUTE = {"Cast": "to", "RandomNormal": "dtype", "RandomUniform": "dtype", "RandomNormalLike": "dtype",
                    "RandomUniformLike": "dtype", "EyeLike": "dtype", "Bernoulli": "dtype"}  # fmt: skip


@dataclass
class MixedPrecisionGraph:
    """The converted forward graph and what the trainer needs to drive it."""

    model: onnx.ModelProto
    backprop_output: str  # ``outputs[0]`` for build_training_graphs: the scaled loss
    loss_output: str  # the user-visible, unscaled loss (unchanged name)
    loss_scale_input: str  # float32 scalar graph input: bind the loss scaler's current scale
    fp16_weights: dict[str, str] = field(default_factory=dict)  # parameter -> its in-graph fp16 Cast output
    fp16_twin_inputs: tuple[str, ...] = ()  # design (ii) twins: none, see the module docstring
    fp16_nodes: list[str] = field(default_factory=list)  # "name (op)" of the nodes that run in float16
    fp32_nodes: dict[str, str] = field(default_factory=dict)  # "name (op)" -> why it stays float32
    inserted_casts: int = 0

    @property
    def fp32_ops(self) -> list[str]:
        """Op types with at least one float node kept in float32."""
        return sorted({key.rsplit(" (", 1)[1][:-1] for key in self.fp32_nodes})

    @property
    def fp16_ops(self) -> list[str]:
        return sorted({key.rsplit(" (", 1)[1][:-1] for key in self.fp16_nodes})


@dataclass(eq=False)
class _Node:
    index: int
    node: onnx.NodeProto
    inputs: list  # type param (str) or None per input, "" for absent optional inputs
    outputs: list
    half: set  # type params converted when the node runs in fp16 (bound to float32 tensors only)
    reason: str = ""  # why it cannot run in fp16 ("" = it may)
    fp16: bool = False

    @property
    def label(self) -> str:
        return f"{self.node.name or f'#{self.index}'} ({self.node.op_type})"

    def half_inputs(self) -> list[tuple[int, str]]:
        """(index, name) of the inputs that become float16 when the node runs in float16."""
        return [
            (i, n) for i, (n, p) in enumerate(zip(self.node.input, self.inputs, strict=True)) if n and p in self.half
        ]

    def half_outputs(self) -> list[tuple[int, str]]:
        return [
            (i, n) for i, (n, p) in enumerate(zip(self.node.output, self.outputs, strict=True)) if n and p in self.half
        ]


def convert_to_mixed_precision(
    forward: onnx.ModelProto,
    *,
    trainable: Sequence[str],
    frozen: Sequence[str],
    loss_output: str,
    support: Mapping[tuple[str, str], bool],
    loss_scale_input: str = LOSS_SCALE_INPUT,
) -> MixedPrecisionGraph:
    """A copy of ``forward`` with fp16 where ``support`` allows it, plus loss scaling. See the module doc.

    ``support`` maps ``(domain, op_type)`` to whether the provider runs it in float16
    (`ort_trainer.graph._fp16_support.provider_fp16_support`; missing = False).
    """
    model = copy.deepcopy(forward)
    graph = model.graph
    if loss_output not in {o.name for o in graph.output}:
        raise ValueError(f"loss output {loss_output!r} is not a graph output")
    taken = _all_names(graph)
    if loss_scale_input in taken:
        raise ValueError(f"cannot add the loss-scale input {loss_scale_input!r}: the graph already uses that name")
    types = _tensor_types(model)
    nodes = [_describe(i, n, model, types) for i, n in enumerate(graph.node)]
    producer = {out: info for info in nodes for out in info.node.output if out}
    consumers: dict[str, list[_Node]] = {}
    for info in nodes:
        for name in info.node.input:
            consumers.setdefault(name, []).append(info)
    pinned = {o.name for o in graph.output} | _subgraph_references(graph)
    tail = _loss_tail(nodes, producer, loss_output, set(trainable) | set(frozen))
    for info in nodes:
        if info.half and not info.reason:
            if info.index in tail:
                info.reason = "loss tail (kept float32 by design)"
            elif not support.get((_domain(info.node.domain), info.node.op_type), False):
                info.reason = "no float16 kernel on the provider"
            elif not _fp16_safe_constant(info.node):
                info.reason = "constant out of float16 range"
    _decide_modes(nodes, producer, consumers, pinned)

    new_types = dict(types)
    for info in nodes:
        if info.fp16:
            for _, name in info.half_outputs():
                new_types[name] = _F16
            _rewrite_type_attributes(info)
    names = _NameMaker(taken)
    result_nodes, casts = _insert_casts(nodes, types, new_types, pinned, names)
    del graph.node[:]
    graph.node.extend(result_nodes)
    _update_value_info(graph, types, new_types)
    scaled = _add_loss_scaling(graph, loss_output, loss_scale_input, names)
    trainable = set(trainable)
    return MixedPrecisionGraph(
        model=model,
        backprop_output=scaled,
        loss_output=loss_output,
        loss_scale_input=loss_scale_input,
        fp16_weights={src: out for (src, want), out in casts.items() if want == _F16 and src in trainable},
        fp16_nodes=[info.label for info in nodes if info.fp16],
        fp32_nodes={info.label: info.reason or _FOLLOWS_FP32 for info in nodes if info.half and not info.fp16},
        inserted_casts=len(casts),
    )


def strip_loss_scaling(model: onnx.ModelProto, mixed: MixedPrecisionGraph) -> None:
    """Remove the loss-scale input, Mul and scaled output from a graph (the eval graph), in place."""
    graph = model.graph
    kept = [n for n in graph.node if mixed.backprop_output not in n.output]
    del graph.node[:]
    graph.node.extend(kept)
    for field_ in (graph.output, graph.input):
        kept_values = [v for v in field_ if v.name not in (mixed.backprop_output, mixed.loss_scale_input)]
        del field_[:]
        field_.extend(kept_values)


# ------------------------------------------------------------------------------------------ analysis
def _describe(index: int, node: onnx.NodeProto, model: onnx.ModelProto, types: dict[str, int]) -> _Node:
    opset = next((o.version for o in model.opset_import if _domain(o.domain) == _domain(node.domain)), 1)
    schema = schema_for(node.domain, node.op_type, opset)
    if schema is None:
        unknown_in, unknown_out = [None] * len(node.input), [None] * len(node.output)  # a contrib op
        return _Node(index, node, unknown_in, unknown_out, set(), "no ONNX schema (kept as is)")
    inputs = _bind(schema.inputs, len(node.input))
    outputs = _bind(schema.outputs, len(node.output))
    present = ([p for n, p in zip(names, params, strict=True) if n] for names, params in
               ((node.input, inputs), (node.output, outputs)))  # fmt: skip
    wanted = fp16_type_params(schema, *present, inputs_too=node.op_type in ("Cast", "CastLike"))
    bound = {}
    for names, params in ((node.input, inputs), (node.output, outputs)):
        for name, param in zip(names, params, strict=True):
            if name and param in wanted:
                bound.setdefault(param, set()).add(types.get(name, 0))
    half = {param for param, kinds in bound.items() if kinds == {_F32}}
    reason = ""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        reason = "has subgraphs"
    elif any(0 in kinds or (_F32 in kinds and len(kinds) > 1) for kinds in bound.values()):
        reason = "tensor types unknown or mixed"
    return _Node(index, node, inputs, outputs, half, reason)


def _bind(params, count: int) -> list:
    """Type string of each actual input/output, following the schema's formal parameters."""
    bound = []
    for i in range(count):
        param = params[min(i, len(params) - 1)] if params else None
        if param is None or (i >= len(params) and param.option != onnx.defs.OpSchema.FormalParameterOption.Variadic):
            bound.append(None)
        else:
            bound.append(param.type_str)
    return bound


def _loss_tail(nodes: list[_Node], producer: dict, loss: str, parameters: set[str]) -> set[int]:
    """Indices of the loss's ancestors that run after the last node reading a parameter."""
    ancestors, stack = set(), [loss]
    while stack:
        info = producer.get(stack.pop())
        if info is not None and info.index not in ancestors:
            ancestors.add(info.index)
            stack.extend(n for n in info.node.input if n)
    readers = {info.index for info in nodes if parameters.intersection(info.node.input)}
    before_readers, stack = set(), [name for i in readers for name in nodes[i].node.input if name]
    while stack:
        info = producer.get(stack.pop())
        if info is not None and info.index not in before_readers:
            before_readers.add(info.index)
            stack.extend(n for n in info.node.input if n)
    return ancestors - readers - before_readers


def _decide_modes(nodes: list[_Node], producer: dict, consumers: dict, pinned: set[str]) -> None:
    """Compute nodes: fp16 when allowed. Followers (movement, constants, casts): grow to a fixed point."""
    followers = []
    for info in nodes:
        if not info.half or info.reason:
            continue
        has_half_input = bool(info.half_inputs())
        if info.node.op_type in _MOVEMENT or not has_half_input or not info.half_outputs():
            followers.append(info)
        else:
            info.fp16 = True
    changed = True
    while changed:
        changed = False
        for info in followers:
            if info.fp16:
                continue
            from_half = any(producer.get(name) is not None and producer[name].fp16 for _, name in info.half_inputs())
            outputs = [name for _, name in info.half_outputs()]
            users = [c for name in outputs for c in consumers.get(name, [])]
            users = [c for c in users if not (c in followers and not c.half_outputs())]  # sinks follow us
            to_half = (
                bool(users)
                and not pinned.intersection(outputs)
                and all(c.fp16 and any(n in outputs for _, n in c.half_inputs()) for c in users)
            )
            if from_half or to_half:
                info.fp16 = changed = True


def _fp16_safe_constant(node: onnx.NodeProto) -> bool:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == _F32:
            values = numpy_helper.to_array(attr.t)
            if values.size and np.abs(values[np.isfinite(values)]).max(initial=0.0) > _FP16_MAX:
                return False
        if attr.name == "value_float" and abs(attr.f) > _FP16_MAX:
            return False
        if attr.name == "value_floats" and any(abs(v) > _FP16_MAX for v in attr.floats):
            return False
    return True


# ------------------------------------------------------------------------------------------ rewriting
def _rewrite_type_attributes(info: _Node) -> None:
    node = info.node
    if not info.half_outputs():
        return
    if node.op_type in ("Constant", "ConstantOfShape"):
        value = _attribute(node, "value")
        if node.op_type == "Constant" and value is None:
            for attr in list(node.attribute):
                if attr.name in ("value_float", "value_floats"):
                    data = np.array(attr.f if attr.name == "value_float" else list(attr.floats), np.float16)
                    node.attribute.remove(attr)
                    node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(data)))
            return
        if value is None:  # ConstantOfShape's default value is a float32 zero
            node.attribute.append(helper.make_attribute("value", helper.make_tensor("value", _F16, [1], [0.0])))
        elif value.t.data_type == _F32:
            value.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(value.t).astype(np.float16), value.t.name))
        return
    attr_name = _DTYPE_ATTRIBUTE.get(node.op_type)
    if attr_name is not None:
        attr = _attribute(node, attr_name)
        if attr is None:
            node.attribute.append(helper.make_attribute(attr_name, _F16))
        elif attr.i == _F32:
            attr.i = _F16


def _insert_casts(nodes: list[_Node], types: dict, new_types: dict, pinned: set[str], names: _NameMaker):
    """The node list with a Cast wherever a consumer wants another float type than its producer gives.

    One Cast per (tensor, type), placed before its first consumer. A pinned tensor (graph output,
    subgraph input) produced in float16 is renamed and cast back under its own name right after its
    producer, so its declared type holds. Returns (nodes, {(source, type): cast output}).
    """
    renamed = {}  # pinned tensor now produced in fp16 -> internal fp16 name
    casts: dict[tuple[str, int], str] = {}
    for info in nodes:
        for i, name in info.half_outputs():
            if info.fp16 and name in pinned:
                renamed[name] = names.new(f"{name}_fp16")
                info.node.output[i] = renamed[name]
                new_types[renamed[name]], new_types[name] = _F16, types[name]
                casts[(renamed[name], types[name])] = name
    result = []
    for info in nodes:
        half_inputs = {i for i, _ in info.half_inputs()} if info.fp16 else set()
        for i, name in enumerate(info.node.input):
            if not name:
                continue
            source = renamed.get(name, name)
            have, want = new_types.get(source, 0), _F16 if i in half_inputs else types.get(name, 0)
            if have in (_F32, _F16) and want in (_F32, _F16) and have != want:
                if (source, want) not in casts:
                    casts[(source, want)] = names.new(f"{name}_{'fp16' if want == _F16 else 'fp32'}")
                    result.append(_cast(source, casts[(source, want)], want, names))
                source = casts[(source, want)]
            info.node.input[i] = source
        result.append(info.node)
        result.extend(_cast(internal, original, types[original], names) for original, internal in renamed.items()
                      if internal in info.node.output)  # fmt: skip
    return result, casts


def _add_loss_scaling(graph: onnx.GraphProto, loss: str, scale_input: str, names: _NameMaker) -> str:
    declared = next(o for o in graph.output if o.name == loss)
    if declared.type.tensor_type.elem_type != _F32:
        raise TypeError(f"the loss output {loss!r} must be float32 for loss scaling")
    scaled = names.new(f"{loss}_scaled")
    graph.input.append(helper.make_tensor_value_info(scale_input, _F32, []))
    graph.node.append(helper.make_node("Mul", [loss, scale_input], [scaled], name=names.new("loss_scale_Mul")))
    output = copy.deepcopy(declared)
    output.name = scaled
    graph.output.append(output)
    return scaled


def _update_value_info(graph: onnx.GraphProto, old: dict[str, int], new: dict[str, int]) -> None:
    for info in graph.value_info:
        if info.type.HasField("tensor_type") and new.get(info.name, 0) != old.get(info.name, 0):
            info.type.tensor_type.elem_type = new[info.name]


def _cast(source: str, target: str, to: int, names: _NameMaker) -> onnx.NodeProto:
    return helper.make_node("Cast", [source], [target], name=names.new(f"{target}_Cast"), to=to)


def _attribute(node: onnx.NodeProto, name: str):
    return next((a for a in node.attribute if a.name == name), None)


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor ONNX shape inference can type (0 = unknown)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - fall back to what the graph declares (unknown types stay fp32)
        graph = model.graph
    types = {init.name: init.data_type for init in graph.initializer}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
    return types


def _subgraph_references(graph: onnx.GraphProto) -> set[str]:
    """Names read inside subgraphs (If/Loop/Scan bodies): their types must not change."""
    found = set()
    for node in graph.node:
        for attr in node.attribute:
            for sub in list(attr.g.node if attr.type == onnx.AttributeProto.GRAPH else []) + [
                n for g in attr.graphs for n in g.node
            ]:
                found.update(sub.input)
    return found


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
    return names


class _NameMaker:
    def __init__(self, taken: set[str]):
        self._taken = set(taken)

    def new(self, base: str) -> str:
        name, i = base, 0
        while name in self._taken:
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        return name
