"""The autograd engine's wing, engine side: PyTorch's own backward, run by any ``onnxruntime``.

Its graphs come from ``graph.autograd`` (the other half of the wing). Nothing outside the wing imports it but the
graph-source registry (``engine._sources``, by name) and ``module/`` (ORTModule shares its graph pieces).

* ``_build``: `build_autograd_engine`, the `Engine` of a torch module or ONNX model (trace, graph cache, export,
  session), `check_autograd_supported`, what the engine refuses at construction, and `exported_graph`, one traced
  graph's ONNX model from the graph cache or the exporter;
* ``_session``: `AutogradSession`, a `StepSession` over the trainer's buffers, one graph per input signature;
* ``_precision``: mixed precision on the provider at hand (autocast where it has low-precision kernels, float32
  math plus loss scaling where it has not);
* ``_source``: `SOURCE`, the `GraphSource` the registry hands out under ``"autograd"``.
"""

from __future__ import annotations

from ._build import exported_graph
from ._source import SOURCE

__all__ = ["SOURCE", "exported_graph"]
