"""Make broadcasting that ONNX Runtime's gradient builder cannot see explicit, so it sums the gradient.

To build the gradient of ``Add(A, B)`` (and Sub, Mul, Div, Pow, Where, Max, Min, Sum, Mean, Expand,
MatMul's batch dimensions) the builder compares the two inputs' inferred shapes to find the axes that
``B`` was broadcast along, and sums B's gradient over them. Where a dimension is symbolic or unknown on
both sides, it assumes the two are equal (ORT 1.19 ``ComputeBroadcastBackwardAxes``: "relaxing case")
and sums nothing. Hugging Face BERT/RoBERTa embeddings add ``position_embeddings(position_ids[:, :seq])``
(shape ``[1, seq, d]``, but inferred as two unknown dimensions) to ``[batch, seq, d]``: the gradient of
the position table then covered only the first sequence (the rest was dropped, or read out of bounds
and crashed the process).

`pin_broadcast_dims` runs the forward graph once on the sample inputs, finds every such input that was
really broadcast along a dimension the shapes did not prove to be 1, and routes it through
``Reshape(x, [.., 1, ..])`` with 1 at those dimensions and 0 (= keep) elsewhere. The values are
unchanged (a Reshape to the same shape); the builder now sees the 1 and sums over that axis.
A sample that is not broadcast where later batches are (e.g. a first batch of size 1 against a
``[1, ...]`` table) cannot show it: use a first batch of the usual size.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ._onnx_util import FLOATS, Dim, NameMaker, constant, replace_nodes, tensor_shapes, tensor_types

__all__ = ["pin_broadcast_dims"]

# op type -> which inputs get a gradient through broadcasting (None: all of them)
_BROADCASTING: dict[str, tuple[int, ...] | None] = {
    "Add": None,
    "Sub": None,
    "Mul": None,
    "Div": None,
    "Pow": None,
    "Max": None,
    "Min": None,
    "Sum": None,
    "Mean": None,
    "Where": (1, 2),
    "Expand": (0,),
    "MatMul": None,
}


# random ops -> the type of their ``seed`` attribute
_RANDOM = {"Dropout": 0, "RandomNormal": 0.0, "RandomUniform": 0.0, "RandomNormalLike": 0.0}
_RANDOM.update({"RandomUniformLike": 0.0, "Bernoulli": 0.0, "Multinomial": 0.0})


def pin_broadcast_dims(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> int:
    """Pin the broadcast dimensions the shapes leave ambiguous (see the module doc); returns the count.

    ``feeds`` are the sample inputs by graph input name. The graph runs (on CPU) only if some input is
    ambiguous; the pass changes nothing when no ambiguous input was broadcast in this sample.
    """
    suspects = _ambiguous_inputs(model)
    if not suspects:
        return 0
    wanted = {name for node, i in suspects for name in (node.input[i], node.output[0])}
    try:
        actual = _run_shapes(model, feeds, wanted)
    except Exception as error:  # noqa: BLE001 - ORT raises its own types; the build must not fail here
        warnings.warn(
            f"could not run the forward graph on the first batch to check broadcast shapes ({error}); "
            "gradients of inputs broadcast along dimensions of unknown size may miss their sum",
            RuntimeWarning,
            stacklevel=2,
        )
        return 0
    pins: dict[tuple[int, int], list[int]] = {}  # (node id, input index) -> Reshape spec
    for node, i in suspects:
        shape = actual[node.input[i]]
        dims = _broadcast_dims(node, shape, actual[node.output[0]])
        if dims:
            pins[(id(node), i)] = [1 if d in dims else 0 for d in range(len(shape))]
    if pins:
        _insert_pins(model, pins)
    return len(pins)


def _insert_pins(model: onnx.ModelProto, pins: dict[tuple[int, int], list[int]]) -> None:
    """Route each pinned input through ``Reshape(x, [1 at pinned dims, 0 elsewhere])`` right before its node."""
    names = NameMaker(model.graph, "pinned_broadcast")
    new_nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        for i, source in enumerate(node.input):
            spec = pins.get((id(node), i))
            if spec is None:
                continue
            shape = constant(new_nodes, names.new("shape"), TensorProto.INT64, spec)
            pinned = names.new(source)
            new_nodes.append(helper.make_node("Reshape", [source, shape], [pinned], name=names.new("Reshape")))
            node.input[i] = pinned
        new_nodes.append(node)
    replace_nodes(model.graph, new_nodes)


def _ambiguous_inputs(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, int]]:
    """(node, input index) of float inputs whose broadcasting the inferred shapes cannot settle."""
    shapes, types = tensor_shapes(model), tensor_types(model)
    found = []
    for node in model.graph.node:
        if node.op_type not in _BROADCASTING or node.domain not in ("", "ai.onnx"):
            continue
        wanted = _BROADCASTING[node.op_type]
        for i, name in enumerate(node.input):
            if not name or (wanted is not None and i not in wanted):
                continue
            if types.get(name, (None, None))[0] not in FLOATS:
                continue
            if _is_ambiguous(node, shapes.get(name), shapes.get(node.output[0])):
                found.append((node, i))
    return found


def _is_ambiguous(node: onnx.NodeProto, shape: list[Dim] | None, out: list[Dim] | None) -> bool:
    if shape is None or out is None or len(shape) > len(out):
        return True
    aligned = out[len(out) - len(shape) :]
    pairs = list(zip(shape, aligned, strict=True))
    if node.op_type == "MatMul":  # only the batch dimensions broadcast
        pairs = pairs[:-2] if len(shape) > 2 else []
    return any(not isinstance(d, int) and (d is None or d != o) for d, o in pairs)


def _broadcast_dims(node: onnx.NodeProto, shape: tuple[int, ...], out: tuple[int, ...]) -> list[int]:
    """Dimensions of ``shape`` (aligned right with ``out``) that are 1 while the output's are not."""
    offset = len(out) - len(shape)
    last = len(shape) - 2 if node.op_type == "MatMul" else len(shape)
    return [d for d in range(max(last, 0)) if shape[d] == 1 and out[offset + d] != 1]


def _run_shapes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], names: set[str]) -> dict[str, tuple]:
    """Run the graph once on CPU and return the real shapes of ``names``.

    Random ops get a ``seed`` attribute in this copy, so they draw from their own generator and leave
    ONNX Runtime's global one (which users reseed, e.g. to resume dropout masks exactly) untouched.
    """
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for node in probe.graph.node:
        seeded = any(a.name == "seed" for a in node.attribute)
        if node.op_type in _RANDOM and node.domain in ("", "ai.onnx") and not seeded:
            node.attribute.append(helper.make_attribute("seed", _RANDOM[node.op_type]))
    del probe.graph.output[:]
    ordered = sorted(names)
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in ordered)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(probe.SerializeToString(), options, ["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    values = session.run(ordered, {k: v for k, v in feeds.items() if k in wanted})
    return {name: tuple(np.shape(value)) for name, value in zip(ordered, values, strict=True)}
