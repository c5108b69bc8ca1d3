"""One rank of tests/module/test_ortmodule_ddp.py: ``DistributedDataParallel(ORTModule(MLP()))`` over gloo.

Each rank trains on its slice of every global batch of 8 with torch's AdamW and clipping; the last step
accumulates two global batches, the first under ``no_sync()`` (micro-batches of the same size: no new
graphs). Rank 0 writes the global mean losses and the final weights (JSON) to the path given; the process
group is torn down at the end.
"""

from __future__ import annotations

import contextlib
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
        batches = mlp_batches(STEPS + 1, batch=BATCH)
        losses = []
        for step in range(STEPS):
            micro = batches[step : step + 2] if step == STEPS - 1 else batches[step : step + 1]
            opt.zero_grad()
            loss = torch.zeros(())
            for i, (x, label) in enumerate(micro):
                x, label = x[rank * per_rank : (rank + 1) * per_rank], label[rank * per_rank : (rank + 1) * per_rank]
                # accumulation: every micro-batch but the last without the all-reduce
                with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    part = torch.nn.functional.cross_entropy(ddp(x), label) / len(micro)
                    part.backward()
                loss += part.detach()
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
