"""The engine's seams, as protocols: a graph source, and a model-parallel plan.

`GraphSource`: builds the graphs and sessions of one trainer (`_sources` registers the onnxblock and autograd
ones). `ModelParallel`: what the engine asks of a model-parallel plan (``ort_trainer.parallel.HorizontalParallel``
implements it), so that the engine names no class of a room above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    import onnx

    from ._build import BuildRequest, Engine
    from ._store import ParamStore

__all__ = ["GraphSource", "ModelParallel"]


class GraphSource(Protocol):
    """Builds the graphs and sessions of one trainer, over the `ParamStore` it already has."""

    name: str

    def build(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
        """The ready engine for ``request``, traced/exported with ``sample_inputs`` (the first step's)."""
        ...


class ModelParallel(Protocol):
    """A model-parallel plan: it builds the session of this rank's segment and knows the global gradient norm."""

    def build_session(
        self, forward: onnx.ModelProto, trainable: list[str], frozen: list[str], store: ParamStore, request: Any
    ) -> Any:
        """A session with `TrainingSession`'s ``run_train``/``run_eval`` over this rank's slice."""
        ...

    def grad_norm(self, grad_views: Mapping[str, torch.Tensor]) -> float:
        """The L2 norm of the whole model's gradient (split weights summed over the group)."""
        ...
