"""A custom PyTorch training loop (plain module, AdamW with two parameter groups, cosine schedule, GradScaler,
dropout, a sampler of its own) for the checkpoint tests of a dict of objects and for ``custom_loop_worker``.

``make_loop()`` builds it from seed 0; ``train(loop, start, stop)`` runs steps ``start``..``stop - 1``. Step ``n``
draws its batch from the sampler's own generator and its dropout masks from torch's global generator, so a
resumed run is bit-exact only if both (and everything else) were restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ort_trainer.checkpoint.objects import RNGState

__all__ = ["Loop", "Sampler", "make_loop", "state_of", "train", "weights"]

STEPS = 12


class Sampler:
    """Batches drawn from a generator of its own; ``state_dict`` holds the generator and the position."""

    def __init__(self, seed: int = 1) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        x = torch.randn(8, 6, generator=self.generator)
        return x, torch.randint(0, 3, (8,), generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.position = int(state["position"])


@dataclass
class Loop:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    sampler: Sampler


def make_loop(seed: int = 0) -> Loop:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)
    )
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS, eta_min=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    return Loop(model, optimizer, scheduler, scaler, Sampler())


def state_of(loop: Loop) -> dict[str, Any]:
    """The dict given to ``CheckpointManager.save`` / ``restore``."""
    return {
        "model": loop.model,
        "optimizer": loop.optimizer,
        "scheduler": loop.scheduler,
        "scaler": loop.scaler,
        "sampler": loop.sampler,
        "rng": RNGState(),
    }


def train(loop: Loop, start: int, stop: int, after_step=None) -> None:
    """Steps ``start``..``stop - 1``: forward with dropout, scaled backward, clipping, AdamW, schedule."""
    loop.model.train()
    for step in range(start, stop):
        x, y = loop.sampler.next_batch()
        loss = torch.nn.functional.cross_entropy(loop.model(x), y)
        loop.scaler.scale(loss).backward()
        loop.scaler.unscale_(loop.optimizer)
        torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 1.0)
        loop.scaler.step(loop.optimizer)
        loop.scaler.update()
        loop.scheduler.step()
        loop.optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step + 1)


def weights(loop: Loop) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
