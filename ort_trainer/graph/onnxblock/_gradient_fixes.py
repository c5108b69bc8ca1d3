"""Work-arounds for two ways ONNX Runtime 1.19's gradient builder goes wrong on broadcasting ops.

1. ``onnx.shape_inference`` (which onnxblock runs) names every dim it cannot infer ``unk__N``. ORT's
   builder takes two *different* symbolic dims of a broadcasting op (Add, Mul, ...) to be equal ("a
   relaxing case"), so when one of them is really 1 -- ``position_ids[:, :seq]`` sliced from a buffer
   (BERT), a position bias (T5) -- the gradient gets no ReduceSum: silently wrong weights, or a kernel
   failing at run time. `forget_unnamed_dims` leaves such dims unknown; the builder then takes its
   dynamic path (``BroadcastGradientArgs``), which is right for any shape.
2. ``Where``'s gradient ignores broadcasting altogether (the gradient of ``x`` in ``Where(c, x, y)`` has
   the output's shape). `expand_where_inputs` makes the broadcast explicit with ``Expand``, whose
   gradient reduces correctly (attention masks applied with ``torch.where`` / ``masked_fill``). Inputs that
   no trainable weight reaches (constants, buffers, a padding row read without a gradient) carry no
   gradient and are left alone.
"""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["expand_where_inputs", "forget_unnamed_dims"]

# Float inputs that ONNX Runtime's gradient builder never differentiates (part of its STOP_GRADIENT_EDGES).
_NO_GRADIENT_INPUTS = {
    "BatchNormalization": {3, 4}, "BatchNormInternal": {3, 4}, "Pow": {1}, "Clip": {1, 2}, "Dropout": {1},
}  # fmt: skip
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
_UNKNOWN = onnx.TensorProto.UNDEFINED
_MAY_BE_FLOAT = _FLOATS | {_UNKNOWN}


def forget_unnamed_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """Clear the ``unk__N`` dim names shape inference invented (the dims stay, unknown); in place."""
    for info in model.graph.value_info:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            for dim in info.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param.startswith("unk__"):
                    dim.ClearField("dim_param")
    return model


def expand_where_inputs(model: onnx.ModelProto, trainable: set[str]) -> int:
    """``Where(c, x, y)`` -> ``Where(c, Expand(Expand(x, Shape(c)), Shape(y)), ...)`` for float ``x``/``y`` that
    may be broadcast and may carry a gradient; returns the number of inputs expanded. Same values."""
    graph = model.graph
    shapes = _static_shapes(model)
    carriers = _gradient_carriers(graph, trainable, shapes)
    taken = (
        {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    )
    nodes, changed = [], 0
    for node in graph.node:
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        out_shape = shapes.get(node.output[0])
        inputs = list(node.input)
        for position in (1, 2):
            name = inputs[position]
            if name not in carriers or shapes.get(name, ("?",)) == out_shape and out_shape is not None:
                continue
            if shapes.get(f"{name}#type") not in _FLOATS:
                continue
            others = [inputs[i] for i in (0, 1, 2) if i != position]
            current = name
            for other in others:
                shape_name, expanded = _fresh(taken, f"{name}_shape_of_{other}"), _fresh(taken, f"{current}_expanded")
                nodes.append(helper.make_node("Shape", [other], [shape_name], name=_fresh(taken, f"{shape_name}_node")))
                nodes.append(
                    helper.make_node(
                        "Expand", [current, shape_name], [expanded], name=_fresh(taken, f"{expanded}_node")
                    )
                )
                current = expanded
            inputs[position] = current
            changed += 1
        del node.input[:]
        node.input.extend(inputs)
        nodes.append(node)
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _gradient_carriers(graph: onnx.GraphProto, trainable: set[str], shapes: dict[str, object]) -> set[str]:
    """Tensors a trainable weight may reach through differentiable inputs: float (or untyped) outputs of nodes
    with such an input. A superset: every op but the listed edges passes a gradient on, as do subgraphs."""
    carriers = set(trainable)
    for node in graph.node:  # ONNX graphs are topologically sorted
        skipped = _NO_GRADIENT_INPUTS.get(node.op_type, set())
        reached = any(name in carriers for i, name in enumerate(node.input) if i not in skipped)
        if reached or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            carriers.update(out for out in node.output if shapes.get(f"{out}#type", _UNKNOWN) in _MAY_BE_FLOAT)
    return carriers


def _fresh(taken: set[str], base: str) -> str:
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _static_shapes(model: onnx.ModelProto) -> dict[str, object]:
    """{tensor: fully static shape tuple or None} and {tensor#type: elem type}, from shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - e.g. a >2 GB model: then every Where is expanded
        inferred = model.graph
    result: dict[str, object] = {}
    for init in inferred.initializer:
        result[init.name] = tuple(init.dims)
        result[f"{init.name}#type"] = init.data_type
    for info in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
        tensor = info.type.tensor_type
        result[f"{info.name}#type"] = tensor.elem_type
        dims = tensor.shape.dim if tensor.HasField("shape") else None
        static = dims is not None and all(d.HasField("dim_value") for d in dims)
        result[info.name] = tuple(d.dim_value for d in dims) if static else None
    return result
