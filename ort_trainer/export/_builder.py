"""`GraphBuilder`: appends standard ONNX nodes (default domain only) to a graph, with unique value names.

The optimizer update and the gradient clipping are written as plain ONNX ops after the autograd engine's
training graph (`_updates`, `_clip`); this is the one place that names their values and constants.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["GraphBuilder"]


class GraphBuilder:
    """Appends nodes and scalar constants to ``graph``; every name it makes starts with ``prefix``."""

    def __init__(self, graph: onnx.GraphProto, prefix: str = "update/"):
        self.graph = graph
        self.prefix = prefix
        self._count = 0
        self._constants: dict[tuple[str, float | int], str] = {}
        self._first = len(graph.node)  # the nodes before are not ours: `rename` leaves them

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def const(self, value: float | int, dtype: str = "float32") -> str:
        """A scalar initializer (shared by every use of the same value and dtype)."""
        key = (dtype, value)
        if key not in self._constants:
            name = self._name(f"c_{dtype}")
            self.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
            self._constants[key] = name
        return self._constants[key]

    def op(self, op_type: str, *inputs: str, name: str | None = None, **attributes: object) -> str:
        """One node of ``op_type`` (default domain) with one output; returns the output's name."""
        output = name or self._name(op_type.lower())
        self.graph.node.append(helper.make_node(op_type, list(inputs), [output], name=output, **attributes))
        return output

    def rename(self, value: str, new: str) -> None:
        """Call the value ``value`` (made by this builder) ``new`` everywhere in the graph."""
        for node in self.graph.node[self._first :]:
            for i, name in enumerate(node.input):
                if name == value:
                    node.input[i] = new
            for i, name in enumerate(node.output):
                if name == value:
                    node.output[i] = new

    def cast(self, value: str, dtype: str) -> str:
        return self.op("Cast", value, to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))

    def finite(self, value: str) -> str:
        """bool tensor: ``value`` is neither NaN nor infinite."""
        return self.op("Not", self.op("Or", self.op("IsNaN", value), self.op("IsInf", value)))

    def norm(self, value: str) -> str:
        """The L2 norm of every element of ``value`` (float32 []): ReduceSumSquare over all axes, then Sqrt."""
        return self.op("Sqrt", self.op("ReduceSumSquare", value, keepdims=0))
