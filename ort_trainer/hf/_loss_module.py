"""What ORTTrainer exports: HF's ``Trainer.compute_loss`` around the model, with inputs named after the batch.

`LossModule.forward(**batch)` calls the (possibly overridden) ``compute_loss`` of the HF trainer, so
the model's own loss, ``compute_loss_func``, label smoothing and a subclass's ``compute_loss`` are all
traced into the ONNX graph. HF's ``num_items_in_batch`` (tokens over the accumulation window, summed
over ranks) becomes a scalar graph input. The loss is multiplied by ``factor`` so that ORTTrainer's
rule (gradients averaged over micro-steps and ranks) gives exactly HF's gradients: ``factor`` is the
number of accumulation steps when HF does not divide the loss by it (the loss is already normalised
over the whole window), else 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["MODEL_PREFIX", "NUM_ITEMS", "LossModule", "describe_inputs", "tensor_inputs"]

NUM_ITEMS = "num_items_in_batch"
MODEL_PREFIX = "model."  # parameter names of the HF model inside LossModule


class LossModule(torch.nn.Module):
    """``forward(**inputs) -> factor * compute_loss(model, inputs, num_items_in_batch)``."""

    def __init__(self, compute_loss: Any, model: torch.nn.Module, factor: float):
        super().__init__()
        self.model = model
        self._compute_loss = compute_loss
        self._factor = float(factor)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        num_items = inputs.pop(NUM_ITEMS, None)
        loss = self._compute_loss(self.model, inputs, num_items_in_batch=num_items)
        if isinstance(loss, tuple):  # an override that always returns (loss, outputs)
            loss = loss[0]
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"compute_loss must return a tensor (the loss), got {type(loss).__name__}")
        loss = loss.reshape(())
        return loss * self._factor if self._factor != 1.0 else loss


def tensor_inputs(inputs: Mapping[str, Any], num_items: Any) -> dict[str, torch.Tensor]:
    """The batch as graph inputs: its tensors by name (None values dropped) + ``num_items_in_batch``."""
    feeds: dict[str, torch.Tensor] = {}
    for name, value in inputs.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"batch entry {name!r} is a {type(value).__name__}; ort_trainer.hf.Trainer feeds only tensors to "
                "ONNX Runtime: make the data collator return tensors (or drop the entry)"
            )
        feeds[name] = value
    if NUM_ITEMS in feeds:
        raise ValueError(f"the batch has an entry named {NUM_ITEMS!r}, which the Trainer passes itself")
    if num_items is not None:
        feeds[NUM_ITEMS] = torch.as_tensor(num_items, dtype=torch.float32).reshape(())
    return feeds


def describe_inputs(feeds: Mapping[str, torch.Tensor]) -> list[tuple[str, list]]:
    """``model_desc`` inputs, every dim symbolic: the first one of each input is ``batch`` and the second one of a
    token input (integer or bool, 2-D or more: ids, masks, token labels) ``seq``, shared by every input, as a
    collator pads them; any other dim is named after its input (``pixel_values.2``) and joins another only where
    the model's ops equate them. A dim the model makes static (image channels) is then static in the graph."""
    described = []
    for name, tensor in feeds.items():
        token = not tensor.is_floating_point() and tensor.dim() >= 2
        dims = [f"{name}.{i}" for i in range(tensor.dim())]
        if dims:
            dims[0] = "batch"
        if token:
            dims[1] = "seq"
        described.append((name, dims))
    return described
