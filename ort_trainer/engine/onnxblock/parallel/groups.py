"""The process groups of a D x H grid: rank ``r`` is horizontal rank ``r % H`` of data-parallel replica ``r // H``.

As in the legacy backend (and Megatron-LM), the ``H`` ranks of a horizontal group are consecutive.
`DataParallelView` is the engine's `DistributedContext` seen from one horizontal position: rank
``r // H`` of the ``D`` ranks holding the same slices, with its collectives on their group, so
gradient averaging, ZeRO partitions and the rank-0 broadcast of the initial weights happen among
replicas of the same slice only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ort_trainer.engine import DistributedContext, buckets

__all__ = ["DataParallelView", "Grid"]


class Grid:
    """This rank's place in the grid and the groups it belongs to (created collectively on every rank)."""

    def __init__(self, world_rank: int, world_size: int, horizontal: int):
        self.world_rank, self.world_size, self.horizontal = world_rank, world_size, horizontal
        self.data_parallel = world_size // horizontal
        self.horizontal_rank = world_rank % horizontal
        self.data_parallel_rank = world_rank // horizontal
        self.horizontal_group = self.data_parallel_group = None
        for d in range(self.data_parallel):  # every rank creates every group, in the same order
            ranks = list(range(d * horizontal, (d + 1) * horizontal))
            group = dist.new_group(ranks)
            if world_rank in ranks:
                self.horizontal_group = group
        for h in range(horizontal):
            ranks = list(range(h, world_size, horizontal))
            group = dist.new_group(ranks)
            if world_rank in ranks:
                self.data_parallel_group, self.data_parallel_ranks = group, ranks


class DataParallelView(DistributedContext):
    """`DistributedContext` over the data-parallel group of this rank's horizontal position."""

    def __init__(self, grid: Grid, device: torch.device):  # joins the existing group; never creates one
        self.rank, self.world_size, self.device = grid.data_parallel_rank, grid.data_parallel, device
        self.group, self._ranks = grid.data_parallel_group, grid.data_parallel_ranks
        self._holds_group = False

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        for bucket in buckets(tensor):
            dist.broadcast(bucket, self._ranks[src], group=self.group)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        for bucket in buckets(tensor):
            dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.group)

    def reduce_to_owners_(self, tensor: torch.Tensor, chunk: int) -> None:
        for owner in range(self.world_size):
            for bucket in buckets(tensor[owner * chunk : (owner + 1) * chunk]):
                dist.reduce(bucket, dst=self._ranks[owner], op=dist.ReduceOp.SUM, group=self.group)

    def all_gather_chunks_(self, tensor: torch.Tensor, chunk: int) -> None:
        parts = [tensor[r * chunk : (r + 1) * chunk] for r in range(self.world_size)]
        dist.all_gather(parts, parts[self.rank].clone(), group=self.group)

    def sum_scalar(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def all_gather_objects(self, value) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def shared_run_id(self) -> str:
        raise RuntimeError("checkpoint coordination uses the trainer's world context, not the data-parallel view")
