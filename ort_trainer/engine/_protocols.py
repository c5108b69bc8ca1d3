"""The engine's seams, as protocols: a graph source and a model-parallel plan (the session they build:
`_step_session.StepSession`).

`GraphSource`: checks what it supports and builds the graphs and sessions of one trainer (each engine wing,
``engine.autograd`` and ``engine.onnxblock``, has one; `_sources` keeps the registry). `ModelParallel`: what the
engine asks of a model-parallel plan (``ort_trainer.parallel.HorizontalParallel`` implements it), and
`ModelParallelFactory` how the assembly makes one (a graph source offers it), so that the engine names no class
of a wing or a room above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    import onnx

    from ._build import BuildRequest, Engine
    from ._step_session import StepSession
    from ._store import ParamStore

__all__ = ["GraphSource", "ModelParallel", "ModelParallelFactory"]


class GraphSource(Protocol):
    """Builds the graphs and sessions of one trainer, over the `ParamStore` it already has."""

    name: str

    def check_supported(self, model: Any, options: Any, desc: Any) -> None:
        """ValueError (at construction, before any process group) for what this source cannot do with ``model``
        (its ``model_desc``: ``desc``) and ``options``, and for an option it would ignore: a refusal, never a
        silently dropped option."""
        ...

    def model_parallel(self) -> ModelParallelFactory | None:
        """The model-parallel plan this source runs (``horizontal_parallel_size > 1``), or None."""
        ...

    def build(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
        """The ready engine for ``request``, traced/exported with ``sample_inputs`` (the first step's)."""
        ...


class ModelParallel(Protocol):
    """A model-parallel plan: it builds the session of this rank's segment and knows the global gradient norm."""

    model: torch.nn.Module  # this rank's slice of the model: the parameter store is built from it
    data_parallel: Any  # the data-parallel view (a `DistributedContext` over the replicas of this slice) or None

    def build_session(
        self, forward: onnx.ModelProto, trainable: list[str], frozen: list[str], store: ParamStore, request: Any
    ) -> StepSession:
        """The `StepSession` of this rank's slice."""
        ...

    def grad_norm(self, grad_views: Mapping[str, torch.Tensor]) -> float:
        """The L2 norm of the whole model's gradient (split weights summed over the group)."""
        ...


class ModelParallelFactory(Protocol):
    """How `assemble_trainer_state` makes a `ModelParallel` plan (``ort_trainer.parallel.HorizontalParallel``)."""

    def check_supported(self, model: Any, options: Any, optim_config: Any) -> None:
        """``NotImplementedError`` for what the plan does not do, before any process group exists."""
        ...

    def __call__(self, model: Any, options: Any, optim_config: Any, device: torch.device) -> ModelParallel: ...
