"""`StepSession`: what every engine's session does for a step, declared once.

`_step`, `_bindings` and the trainer's state code call these members on whatever session the chosen graph source
built (the autograd engine's `AutogradSession`, the onnxblock engine's `TrainingSession`, Megatron's
`ParallelSession`), so that none of them probes a session for what it may have. A leaf: it imports nothing of the
engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    import onnx

__all__ = ["StepSession"]


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
