"""The onnxblock engine's wing, engine side: onnxruntime-training's C++ gradient builder.

Its graphs come from ``graph.onnxblock`` (TorchScript export, graph passes, fp16 graphs, CPU rewrites) and its
model-parallel plan from ``ort_trainer.parallel`` (Megatron): both are the wing's too. Nothing outside the wing
imports it but the graph-source registry (``engine._sources``, by name).

* ``_build``: `build_onnxblock_engine`, export -> graph passes -> gradient graph -> session (or Megatron's
  segment sessions);
* ``_graphs``: the gradient graph from onnxruntime-training's onnxblock (the one module that imports
  ``onnxruntime.training``, when a graph is built);
* ``_session``: `TrainingSession`, a `StepSession`: IOBinding of the flat buffers and the runs;
* ``_source``: `SOURCE`, the `GraphSource` the registry hands out under ``"onnxblock"``.
"""

from __future__ import annotations

from ._source import SOURCE

__all__ = ["SOURCE"]
