"""``Gather`` of float data along axis 0 -> ``GatherND``: same values, a fast gradient on CPU.

ONNX Runtime 1.19's CPU ``GatherGrad`` takes a mutex for every gradient element it adds, ~8 ms per
node with two threads. It is the gradient of the embedding ``Gather`` and, six times in a 2-layer
encoder, of the q/k/v split (``proj[0]``, ``proj[1]``, ``proj[2]``) of ``nn.MultiheadAttention``'s packed
in-projection. ``GatherND`` with the indices unsqueezed computes the same values; its gradient
``GatherNDGrad`` is a plain loop: ~0.7 ms per node.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._onnx_util import FLOATS, NameMaker, default_opset, int_attr, replace_nodes, tensor_types, unsqueeze

__all__ = ["gather_to_gather_nd"]


def gather_to_gather_nd(model: onnx.ModelProto) -> int:
    """``Gather(data, idx, axis=0)`` of float ``data`` -> ``GatherND(data, Unsqueeze(idx, -1))``.

    Same output (``idx.shape + data.shape[1:]``, scalar ``idx`` included); the gradient becomes
    ``GatherNDGrad`` instead of the mutex-per-element ``GatherGrad``. Covers embeddings (``data`` an
    initializer) and the q/k/v split of a packed attention projection (``proj[0]``, ``proj[1]``...).
    """
    graph = model.graph
    types = tensor_types(model)
    names = NameMaker(graph, "gather_nd")
    opset = default_opset(model)
    changed = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        data_type, rank = types.get(node.input[0], (None, None)) if node.op_type == "Gather" else (None, None)
        axis = int_attr(node, "axis", 0)
        if (
            node.domain not in ("", "ai.onnx")
            or data_type not in FLOATS
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
        unsqueeze(indices, unsqueezed, -1, opset, names, new_nodes)
        new_nodes.append(
            helper.make_node(
                "GatherND", [node.input[0], unsqueezed], list(node.output), name=node.name or names.new("GatherND")
            )
        )
        changed += 1
    replace_nodes(graph, new_nodes)
    return changed
