"""Custom training loops on ONNX Runtime: `ORTModule` and the ``torch.compile`` backend ``"ort_trainer"``.

* ``_graph``: `OrtGraph`, one AOTAutograd graph (forward, backward or inference) exported to ONNX and run in
  ONNX Runtime over torch tensors (DLPack, outputs allocated by torch on the device);
* ``_export``: a graph's export through the on-disk graph cache, its errors told in ORTModule's terms;
* ``_sizes``: `SymbolicSizes`, a graph whose sizes Dynamo made symbolic exported once for every size (its int
  inputs read from the tensors' shapes, what a call sizes evaluated from them);
* ``_per_shape``: `PerShapeGraphs`, a symbolic graph the exporter refuses run as one static graph per shape;
* ``_backend``: `ort_backend`, AOTAutograd with ``default_partition`` and the autograd engine's
  decompositions, each graph compiled to an `OrtGraph` (registered as ``backend="ort_trainer"``);
* ``_ortmodule``: `ORTModule`, the wrapped module captured as one graph (symbolic in the dims that change), its
  state dict the module's own.

This room uses the public names of ``graph.autograd`` (tracing decompositions, exporter, graph cache) and
``engine`` (devices, DLPack binding); nothing below it imports it (docs/architecture.md).
"""

from __future__ import annotations

from ._backend import ort_backend
from ._ortmodule import ORTModule

__all__ = ["ORTModule", "ort_backend"]
