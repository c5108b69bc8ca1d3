"""``RNGState``: the process's random number generators as one Stateful object for a checkpoint.

A resumed custom loop draws the same dropout masks and shuffles as the uninterrupted run only if the
generators continue where they were: torch's CPU generator (and every CUDA device's, when CUDA is
initialised), Python's ``random`` and numpy's global generator. Put ``RNGState()`` into the dict given to
``CheckpointManager.save``; its state is tensors, ints and tuples (no pickle).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ..format.lazy_torch import torch

__all__ = ["RNGState"]


class RNGState:
    """torch (CPU and CUDA), Python ``random`` and numpy's global generator: ``state_dict`` / ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every generator; ValueError naming the entry before any is set if one is malformed."""
        try:
            cpu = state["torch"]
            version, internal, gauss = state["python"]
            python = (int(version), tuple(int(x) for x in internal), gauss)
            numpy_state = tuple(state["numpy"])
            cuda = state.get("cuda")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not an RNGState state_dict ({type(exc).__name__}: {exc}); keys: {sorted(state)}"
            ) from None
        if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8):
            raise ValueError(f"RNGState 'torch' must be a uint8 tensor (torch.get_rng_state()), got {cpu!r:.80}")
        if cuda is not None and len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"RNGState holds {len(cuda)} CUDA generators, this process sees {torch.cuda.device_count()}"
            )
        previous = self.state_dict()
        try:
            np.random.set_state(numpy_state)
            random.setstate(python)
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        except BaseException:
            np.random.set_state(previous["numpy"])
            random.setstate(previous["python"])
            torch.set_rng_state(previous["torch"])
            raise
