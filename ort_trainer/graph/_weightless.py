"""Graphs without weights: model state travels through the build as shapes, never as data.

The trainer's state (parameters, frozen weights, float buffers) lives in its flat torch buffers from
construction on, and the training and eval graphs take it as graph inputs. So the graphs built in
between never need the values: the exporter runs with ``export_params=False`` and every state tensor
becomes a *shell* initializer (name, element type and dims, no data), which graph passes and shape
inference read like any other initializer. Before the gradient graph is built the shells turn into
graph inputs (what onnxblock does with initializers anyway). A GPT-2 124M build thus never holds the
0.5 GB of weights as protobuf bytes, nor serializes them again at each of onnxblock's copies, shape
inference runs and gradient-builder calls. Where a user or a debug option wants a complete model
(``graph_save_paths``, ``_internal_use.extra_postprocess``), `with_values` fills the data in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

__all__ = [
    "checkable",
    "copy_without_data",
    "initializer_data_bytes",
    "onnx_model_parameters",
    "shell_initializer",
    "shells_to_inputs",
    "strip_data",
    "with_values",
]

_DATA_FIELDS = (
    "raw_data",
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
    "external_data",
)


def shell_initializer(name: str, elem_type: int, dims: Iterable[int]) -> onnx.TensorProto:
    """An initializer that declares a tensor (name, type, shape) without its data."""
    shell = onnx.TensorProto(name=name, data_type=elem_type)
    shell.dims.extend(int(d) for d in dims)
    return shell


def strip_data(tensor: onnx.TensorProto) -> None:
    """Drop ``tensor``'s data in place (it becomes a shell)."""
    for name in _DATA_FIELDS:
        tensor.ClearField(name)
    tensor.ClearField("data_location")


def initializer_data_bytes(model: onnx.ModelProto) -> int:
    """Bytes of data the main graph's initializers carry (0 for a graph of shells)."""
    return sum(len(init.raw_data) + (0 if _is_shell(init) else init.ByteSize()) for init in model.graph.initializer)


def copy_without_data(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers in ``names`` are shells; the original is not copied whole."""
    wanted = set(names)
    copied = onnx.ModelProto()
    _copy_fields(model, copied, skip="graph")
    _copy_fields(model.graph, copied.graph, skip="initializer")
    for init in model.graph.initializer:
        if init.name in wanted:
            copied.graph.initializer.append(shell_initializer(init.name, init.data_type, init.dims))
        else:
            copied.graph.initializer.append(init)
    return copied


def _copy_fields(source, target, skip: str) -> None:
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def shells_to_inputs(model: onnx.ModelProto, names: Iterable[str]) -> None:
    """Turn the initializers in ``names`` into graph inputs of their type and shape (in initializer order)."""
    wanted = set(names)
    kept = []
    for init in model.graph.initializer:
        if init.name in wanted:
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def with_values(model: onnx.ModelProto, values: Mapping[str, torch.Tensor | np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose shell initializers named in ``values`` carry those values (complete model)."""
    filled = copy_without_data(model, ())
    for init in filled.graph.initializer:
        tensor = values.get(init.name)
        if tensor is not None and _is_shell(init):
            array = tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
            array = array.astype(helper.tensor_dtype_to_np_dtype(init.data_type))
            init.CopyFrom(numpy_helper.from_array(array, init.name))
    return filled


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose shell initializers hold zeros: ``onnx.checker`` rejects tensors without data."""
    zeros = {
        init.name: np.zeros(tuple(init.dims), helper.tensor_dtype_to_np_dtype(init.data_type))
        for init in model.graph.initializer
        if _is_shell(init)
    }
    return with_values(model, zeros)


def _is_shell(init: onnx.TensorProto) -> bool:
    """No data in any of the tensor's data fields (raw bytes or typed lists)."""
    return not init.raw_data and not any(len(getattr(init, f)) for f in _DATA_FIELDS if f != "raw_data")


def onnx_model_parameters(model: onnx.ModelProto) -> list[str]:
    """Float initializers of a user-given ONNX model: its parameters (everything else is a constant)."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
    return [init.name for init in model.graph.initializer if init.data_type in floats]
