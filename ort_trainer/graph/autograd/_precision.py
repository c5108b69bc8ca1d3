"""`Precision`: how a traced graph computes (float32, or PyTorch's autocast) and whether its loss is scaled.

Mixed precision on the autograd engine is PyTorch's own: the step is traced under ``torch.autocast``, so the
aten graph holds the casts autocast inserts (weights and activations cast to float16/bfloat16 before the ops
autocast runs in low precision, back to float32 before the ops it keeps in float32) and their backward. The
trainable parameters stay float32 graph inputs (the flat master buffer) and their gradients come out float32
(the backward of a cast is a cast back), straight into the flat gradient buffer, as without mixed precision.

Loss scaling is ``torch.amp.GradScaler.scale``: the backward starts from ``loss * loss_scale``, where
``loss_scale`` is a float32 0-d graph input (`LOSS_SCALE_INPUT`) fed by the trainer from its loss scaler, so
the gradient outputs are the scaled gradients; the trainer checks them for finiteness and unscales them before
the update (`engine._step`). The returned loss is the unscaled one; model outputs that autocast left in low
precision are returned in float32, as the onnxblock engine's graphs return them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["LOSS_SCALE_INPUT", "Precision"]

LOSS_SCALE_INPUT = "loss_scale"  # the same name as the onnxblock engine's (`graph.onnxblock._mixed_precision`)
_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Precision:
    """``autocast``: torch.float16 or torch.bfloat16 to trace under ``torch.autocast`` with that dtype, None for
    float32 math. ``loss_scale``: the training graph takes `LOSS_SCALE_INPUT` and returns scaled gradients."""

    autocast: torch.dtype | None = None
    loss_scale: bool = False

    def __post_init__(self) -> None:
        if self.autocast is not None and self.autocast not in _LOW:
            raise ValueError(f"autocast dtype must be torch.float16 or torch.bfloat16, got {self.autocast}")

    @property
    def mixed(self) -> bool:
        return self.autocast is not None or self.loss_scale

    def cache_options(self) -> dict[str, object]:
        """What the graph cache's key adds for this precision (nothing for plain float32: keys stay as they were)."""
        if not self.mixed:
            return {}
        return {"autocast": str(self.autocast).removeprefix("torch."), "loss_scale": self.loss_scale}

    def extra_inputs(self, training: bool) -> list[str]:
        """The graph inputs this precision adds after the ``model_desc`` inputs."""
        return [LOSS_SCALE_INPUT] if training and self.loss_scale else []

    @contextlib.contextmanager
    def forward(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The model and loss run inside this: ``torch.autocast`` on the device of ``tensors`` (else nothing)."""
        if self.autocast is None:
            yield
            return
        device = next((t.device.type for t in tensors), "cpu")
        with torch.autocast(device_type=device, dtype=self.autocast):
            yield

    def outputs(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's ``model_desc`` outputs: those autocast left in low precision as float32."""
        if self.autocast is None:
            return list(values)
        return [v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW else v for v in values]
