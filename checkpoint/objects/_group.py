"""The process group a custom loop runs in, seen from a checkpoint: this rank, the world size, an all-gather.

The default group of ``torch.distributed`` when one is initialised (DDP, ZeRO), else one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..format.lazy_torch import torch

__all__ = ["ProcessGroup", "current_group"]


@dataclass(frozen=True)
class ProcessGroup:
    """``rank`` and ``world_size`` of this process, and ``all_gather_object`` over the default group."""

    rank: int
    world_size: int

    def all_gather_object(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, value)
        return gathered


def current_group() -> ProcessGroup:
    """The default process group's view (rank 0 of 1 when torch.distributed is not initialised)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return ProcessGroup(dist.get_rank(), dist.get_world_size())
    return ProcessGroup(0, 1)
