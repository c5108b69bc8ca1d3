"""Small, general ONNX graph passes run between export and gradient building.

The ONNX Runtime gradient builder needs some optional outputs declared (LayerNormalization's mean and
inverse std, Dropout's mask, SoftmaxCrossEntropyLoss's log_prob), and BatchNormalization in training
mode computes new running statistics that the exported graph drops on the floor. These passes fix
both, in place, without knowing anything about the model that produced the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

__all__ = [
    "BatchNormStats",
    "add_optional_outputs",
    "initializer_names",
    "strip_batchnorm_statistics",
    "surface_batchnorm_statistics",
]

# op type -> number of outputs the gradient builder expects to be declared.
_REQUIRED_OUTPUTS = {"LayerNormalization": 3, "Dropout": 2, "SoftmaxCrossEntropyLoss": 2}


@dataclass(frozen=True)
class BatchNormStats:
    """Where one BatchNorm node's running statistics go in and come out of the graph."""

    running_mean: str  # graph input (initializer name) holding the running mean
    running_var: str
    new_mean_output: str  # graph output with the updated running mean
    new_var_output: str
    input_shape_output: str  # graph output with Shape(X), to correct the variance by n/(n-1)
    momentum: float  # ONNX momentum (= 1 - torch momentum)


def initializer_names(model: onnx.ModelProto) -> list[str]:
    """Names of the graph's initializers, in graph order."""
    return [init.name for init in model.graph.initializer]


def add_optional_outputs(model: onnx.ModelProto) -> int:
    """Declare the optional outputs the gradient builder needs; returns how many nodes changed."""
    changed = 0
    for index, node in enumerate(model.graph.node):
        wanted = _REQUIRED_OUTPUTS.get(node.op_type)
        if wanted is None or len(node.output) >= wanted:
            continue
        base = node.name or f"{node.op_type}_{index}"
        while len(node.output) < wanted:
            node.output.append(f"{base}.optional_output_{len(node.output)}")
        changed += 1
    return changed


def surface_batchnorm_statistics(model: onnx.ModelProto) -> list[BatchNormStats]:
    """Make each training-mode BatchNorm's updated running stats (and its input shape) graph outputs.

    The running stats must be initializers; they become frozen (non-trainable) graph inputs when the
    gradient graph is built, and the trainer copies the outputs back after every train step.
    """
    initializers = {init.name for init in model.graph.initializer}
    stats: list[BatchNormStats] = []
    new_nodes = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "BatchNormalization" or not _training_mode(node):
            continue
        if len(node.input) < 5 or node.input[3] not in initializers or node.input[4] not in initializers:
            continue
        base = node.name or f"BatchNormalization_{index}"
        while len(node.output) < 3:
            node.output.append(f"{base}.running_stat_{len(node.output)}")
        shape_output = f"{base}.input_shape"
        new_nodes.append(helper.make_node("Shape", [node.input[0]], [shape_output], name=f"{base}.Shape"))
        stats.append(
            BatchNormStats(
                running_mean=node.input[3],
                running_var=node.input[4],
                new_mean_output=node.output[1],
                new_var_output=node.output[2],
                input_shape_output=shape_output,
                momentum=_momentum(node),
            )
        )
    model.graph.node.extend(new_nodes)
    for stat in stats:
        model.graph.output.extend(
            [
                helper.make_tensor_value_info(stat.new_mean_output, TensorProto.FLOAT, None),
                helper.make_tensor_value_info(stat.new_var_output, TensorProto.FLOAT, None),
                helper.make_tensor_value_info(stat.input_shape_output, TensorProto.INT64, None),
            ]
        )
    return stats


def strip_batchnorm_statistics(model: onnx.ModelProto, stats: list[BatchNormStats]) -> None:
    """Remove what `surface_batchnorm_statistics` added: for eval graphs, where BatchNorm is in inference mode."""
    extra = {name for s in stats for name in (s.new_mean_output, s.new_var_output, s.input_shape_output)}
    kept_outputs = [out for out in model.graph.output if out.name not in extra]
    del model.graph.output[:]
    model.graph.output.extend(kept_outputs)
    kept_nodes = [n for n in model.graph.node if not (n.op_type == "Shape" and n.output[0] in extra)]
    for node in kept_nodes:
        if node.op_type == "BatchNormalization" and not _training_mode(node):
            del node.output[1:]
    del model.graph.node[:]
    model.graph.node.extend(kept_nodes)


def _training_mode(node: onnx.NodeProto) -> bool:
    return any(a.name == "training_mode" and a.i == 1 for a in node.attribute)


def _momentum(node: onnx.NodeProto) -> float:
    for attr in node.attribute:
        if attr.name == "momentum":
            return float(attr.f)
    return 0.9  # the ONNX default
