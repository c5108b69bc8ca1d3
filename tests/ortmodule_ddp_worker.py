"""One rank of tests/module/test_ortmodule_ddp.py: ``DistributedDataParallel(ORTModule(MLP()))`` over gloo.

Each rank trains on its slice of every global batch of 8 with torch's AdamW, clipping, and, on the last
step, two micro-batches of which the first runs under ``no_sync()``. Rank 0 writes the global mean losses
and the final weights (JSON) to the path given; the process group is torn down at the end.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ort_trainer import ORTModule
from tests.models import MLP, mlp_batches

STEPS, BATCH = 3, 8


def main(out: str) -> None:
    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = MLP()
        ddp = DistributedDataParallel(ORTModule(model))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
        per_rank = BATCH // world
        losses = []
        for step, (x, label) in enumerate(mlp_batches(STEPS, batch=BATCH)):
            x, label = x[rank * per_rank : (rank + 1) * per_rank], label[rank * per_rank : (rank + 1) * per_rank]
            opt.zero_grad()
            if step == STEPS - 1:  # gradient accumulation: the first micro-batch without the all-reduce
                half = per_rank // 2
                with ddp.no_sync():
                    first = torch.nn.functional.cross_entropy(ddp(x[:half]), label[:half]) / 2
                    first.backward()
                second = torch.nn.functional.cross_entropy(ddp(x[half:]), label[half:]) / 2
                second.backward()
                loss = (first + second).detach()
            else:
                loss = torch.nn.functional.cross_entropy(ddp(x), label)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.5)
            opt.step()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        if rank == 0:
            weights = {k: v.tolist() for k, v in ddp.module.state_dict().items()}
            with open(out, "w") as handle:
                json.dump({"losses": losses, "weights": weights}, handle)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
