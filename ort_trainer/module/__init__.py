"""Custom training loops on ONNX Runtime: `ORTModule` and the ``torch.compile`` backend ``"ort_trainer"``.

* ``_graph``: `OrtGraph`, one AOTAutograd graph (forward, backward or inference) exported to ONNX and run in
  ONNX Runtime over torch tensors (DLPack, outputs allocated by torch on the device);
* ``_backend``: `ort_backend`, AOTAutograd with ``default_partition`` and the autograd engine's
  decompositions, each graph compiled to an `OrtGraph` (registered as ``backend="ort_trainer"``);
* ``_ortmodule``: `ORTModule`, the wrapped module captured as one graph per signature, its state dict the
  module's own.

This room uses the public names of ``graph.autograd`` (tracing decompositions, exporter, graph cache) and
``engine`` (devices, DLPack binding); nothing below it imports it (docs/architecture.md).
"""

from __future__ import annotations

from ._backend import ort_backend
from ._ortmodule import ORTModule

__all__ = ["ORTModule", "ort_backend"]
