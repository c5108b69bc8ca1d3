"""The engine's seams, as protocols: a graph source, the session it builds, and a model-parallel plan.

`GraphSource`: checks what it supports and builds the graphs and sessions of one trainer (each engine wing,
``engine.autograd`` and ``engine.onnxblock``, has one; `_sources` keeps the registry). `StepSession`: what
`_step`, `_bindings` and the trainer's state code ask of every session, so that none of them probes a session
for what it may have. `ModelParallel`: what the engine asks of a model-parallel plan
(``ort_trainer.parallel.HorizontalParallel`` implements it), and `ModelParallelFactory` how the assembly makes
one (a graph source offers it), so that the engine names no class of a room above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    import onnx

    from ._build import BuildRequest, Engine
    from ._store import ParamStore

__all__ = ["GraphSource", "ModelParallel", "ModelParallelFactory", "StepSession"]


class StepSession(Protocol):
    """The graphs of one trainer in ONNX Runtime, bound once to the `ParamStore`'s buffers."""

    # whether a training run draws random numbers (Dropout) that `seed_step` must seed before it
    draws_randomness: bool

    def seed_step(self, seed: int) -> None:
        """Seed the random draws of the next training run (a function of run seed, rank and step: `_random`)."""
        ...

    def rebind_state(self) -> None:
        """Bind the state and gradient buffers again: their storage moved in place (`_bindings`)."""
        ...

    def run_train(self, inputs: Mapping[str, torch.Tensor], reset_grad: bool) -> dict[str, torch.Tensor]:
        """One forward + backward; gradients overwrite the buffers (``reset_grad``) or are added to them."""
        ...

    def run_eval(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One forward of the eval graph; the ``model_desc`` outputs it computes."""
        ...

    def eval_graph(self) -> onnx.ModelProto:
        """A copy of the eval graph with the state as inputs, runnable by any onnxruntime (``save_as_onnx``)."""
        ...

    def explain_failure(self, inputs: Mapping[str, torch.Tensor], error: Exception) -> Exception | None:
        """A failed run explained in the user's terms (naming the input at fault), or None."""
        ...


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
