"""Small helpers shared by the graph rewrites: fresh names, tensor types, attributes, node lists."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

__all__ = [
    "FLOATS",
    "NameMaker",
    "constant",
    "default_opset",
    "int_attr",
    "replace_nodes",
    "str_attr",
    "tensor_shapes",
    "tensor_types",
    "topological_sort",
    "unsqueeze",
]

FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


class NameMaker:
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


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[int, int | None]]:
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


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def int_attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return int(attr.i)
    return default


def str_attr(node: onnx.NodeProto, name: str, default: str) -> str:
    for attr in node.attribute:
        if attr.name == name:
            return attr.s.decode()
    return default


def constant(nodes: list[onnx.NodeProto], name: str, dtype: int, values: list) -> str:
    """A ``Constant`` node (not an initializer: those would look like parameters to the trainer)."""
    nodes.append(
        helper.make_node(
            "Constant", [], [name], name=name, value=helper.make_tensor(name, dtype, [len(values)], values)
        )
    )
    return name


def unsqueeze(source: str, target: str, axis: int, opset: int, names: NameMaker, nodes: list) -> None:
    if opset >= 13:
        axes = constant(nodes, names.new("unsqueeze_axes"), TensorProto.INT64, [axis])
        nodes.append(helper.make_node("Unsqueeze", [source, axes], [target], name=names.new("Unsqueeze")))
    else:
        nodes.append(helper.make_node("Unsqueeze", [source], [target], name=names.new("Unsqueeze"), axes=[axis]))


def replace_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    kept = list(nodes)
    del graph.node[:]
    graph.node.extend(kept)


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorder ``graph.node`` so every node comes after the producers of its inputs (stable otherwise)."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producer = {out: index for index, node in enumerate(graph.node) for out in node.output}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        waiting = []
        for node in pending:
            ready = all(name in available or name not in producer for name in node.input)
            if ready:
                ordered.append(node)
                available.update(node.output)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):  # a cycle or a dangling input: keep the rest as it was
            ordered.extend(waiting)
            break
        pending = waiting
    replace_nodes(graph, ordered)


Dim = int | str | None  # a known size, a symbolic name, or unknown


def tensor_shapes(model: onnx.ModelProto) -> dict[str, list[Dim] | None]:
    """Shape of every tensor as ONNX shape inference sees it (None: rank unknown)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - e.g. a >2 GB model: fall back to what the graph declares
        inferred = model.graph
    shapes: dict[str, list[Dim] | None] = {init.name: list(init.dims) for init in inferred.initializer}
    for node in inferred.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes[node.output[0]] = list(node.attribute[0].t.dims)
    for info in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
        tensor_type = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tensor_type is None or not tensor_type.HasField("shape"):
            shapes.setdefault(info.name, None)
            continue
        shapes[info.name] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
        ]
    return shapes
