"""`PerShapeGraphs`: a graph with symbolic sizes that the exporter cannot export with them, run as one static
`OrtGraph` per call's sizes.

The graph is traced again (``make_fx`` in fake mode) with the call's tensors and sizes, which makes every size a
constant; the static graph is built as any other and kept for the next call of the same shapes. Slower to build
than one symbolic graph, never wrong, never eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from ort_trainer.graph.autograd import GraphCache

from ._graph import OrtGraph

__all__ = ["PerShapeGraphs"]


class PerShapeGraphs:
    """Called as an `OrtGraph` (boxed); builds one per distinct (shapes, dtypes, sizes) of its inputs."""

    _boxed_call = True

    def __init__(self, module: torch.fx.GraphModule, kind: str, cache: GraphCache | None):
        self.module, self.kind, self.cache = module, kind, cache
        self.graphs: dict[tuple, OrtGraph] = {}

    def __call__(self, *given: Any) -> list:
        if len(given) == 1 and isinstance(given[0], list):
            inputs = list(given[0])
            given[0].clear()
        else:
            inputs = list(given)
        key = tuple(_key(x) for x in inputs)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._static(inputs)
        return graph([x for x in inputs if isinstance(x, torch.Tensor)])

    def _static(self, inputs: Sequence) -> OrtGraph:
        """The graph traced with these inputs' sizes as constants: a graph of the tensors only."""
        sizes = {i: x for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)}
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]

        def run(*values: torch.Tensor) -> Any:
            args = list(values)
            for index in sorted(sizes):
                args.insert(index, sizes[index])
            return self.module(*args)

        # built while AOTAutograd runs the graph: outside its dispatch modes, as at compile time
        with _disable_current_modes():
            static = make_fx(run, tracing_mode="fake")(*tensors)
            return OrtGraph(static, tensors, self.kind, self.cache)


def _key(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    return (value,)
