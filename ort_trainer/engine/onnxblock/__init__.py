"""The onnxblock engine's wing, engine side: onnxruntime-training's C++ gradient builder.

Its graphs come from ``graph.onnxblock`` (TorchScript export, graph passes, fp16 graphs, CPU rewrites), the other
half of the wing. Nothing outside the wing imports it but the graph-source registry (``engine._sources``, by name)
and ``ort_trainer.parallel``, the public door of its Megatron plan.

* ``_build``: `build_onnxblock_engine`, export -> graph passes -> gradient graph -> session (or Megatron's
  segment sessions);
* ``_graphs``: the gradient graph from onnxruntime-training's onnxblock (the one module that imports
  ``onnxruntime.training``, when a graph is built);
* ``_session``: `TrainingSession`, a `StepSession`: IOBinding of the flat buffers and the runs;
* ``_source``: `SOURCE`, the `GraphSource` the registry hands out under ``"onnxblock"`` (with Megatron's plan);
* ``parallel``: Megatron (horizontal parallel): the plan, the model's slices, the graph cut into segments, the
  segment runner, the D x H process groups (public as ``ort_trainer.parallel``; docs/megatron.md).
"""

from __future__ import annotations

from ._source import SOURCE

__all__ = ["SOURCE"]
