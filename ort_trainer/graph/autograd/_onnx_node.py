"""`OnnxNode`: one node of a user-given ONNX graph as `OnnxModule` runs it, and the helpers its torch ops share.

A node's input is a torch tensor when it depends on the model's inputs or parameters, a numpy array when it is
known at trace time (a constant, an integer initializer, a shape), or None when the optional input is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from ._trace import TraceError

__all__ = ["TORCH_DTYPES", "OnnxNode", "Value", "as_tensor", "input_or_attr", "optional", "static_float", "static_ints"]

Value = Any  # torch.Tensor (computed at run time), np.ndarray (known at trace time) or None (an absent input)

TORCH_DTYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}


@dataclass
class OnnxNode:
    """One node of the graph, with its attributes read once (strings decoded)."""

    op_type: str
    name: str
    inputs: list[str]
    outputs: list[str]
    opset: int
    attrs: dict[str, Any] = field(default_factory=dict)
    training: bool = False  # the module's mode (Dropout, BatchNormalization) while it runs

    @classmethod
    def from_proto(cls, node: onnx.NodeProto, opset: int, index: int) -> OnnxNode:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        name = node.name or f"{node.op_type}_{index}"
        return cls(node.op_type, name, list(node.input), list(node.output), opset, attrs)

    def fail(self, why: str) -> TraceError:
        """The error for a node whose attributes or inputs this engine has no route for."""
        return TraceError(
            f"ONNX node {self.name!r} ({self.op_type}): {why}; train this model with "
            "options={'utils': {'engine': 'onnxblock'}} where onnxruntime-training is installed"
        )


def as_tensor(value: Value, like: Sequence[Value] = ()) -> torch.Tensor:
    """``value`` as a torch tensor; a numpy array becomes a constant on the device of ``like``'s tensors."""
    if isinstance(value, torch.Tensor):
        return value
    device = next((v.device for v in like if isinstance(v, torch.Tensor)), None)
    return torch.tensor(np.asarray(value), device=device)  # a copy: ONNX's arrays are often read-only


def optional(inputs: Sequence[Value], index: int, like: Sequence[Value] = ()) -> torch.Tensor | None:
    """Input ``index`` as a tensor, or None where the node leaves it out."""
    return as_tensor(inputs[index], like or inputs) if len(inputs) > index and inputs[index] is not None else None


def static_ints(node: OnnxNode, value: Value, what: str) -> list[int]:
    """A value the op needs at trace time (a shape, axes, starts) as Python ints."""
    if isinstance(value, torch.Tensor):
        raise node.fail(f"its {what} is computed from tensor values at run time (one traced graph needs it fixed)")
    return [int(v) for v in np.asarray(value).reshape(-1)]


def input_or_attr(node: OnnxNode, inputs: Sequence[Value], index: int, attr: str, what: str) -> list[int] | None:
    """Axes/splits/pads given as an input (newer opsets) or an attribute (older ones); None when neither is."""
    if len(inputs) > index and inputs[index] is not None:
        return static_ints(node, inputs[index], what)
    value = node.attrs.get(attr)
    return None if value is None else [int(v) for v in value]


def static_float(node: OnnxNode, inputs: Sequence[Value], index: int, what: str, default: float) -> float:
    """Optional input ``index``, a scalar the op needs at trace time (Dropout's ratio), or ``default``."""
    if len(inputs) <= index or inputs[index] is None:
        return default
    if isinstance(inputs[index], torch.Tensor):
        raise node.fail(f"its {what} is computed from tensor values at run time (one traced graph needs it fixed)")
    return float(np.asarray(inputs[index]))
