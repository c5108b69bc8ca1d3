"""One rank of the elastic-restart test of the custom loop (issue S item 8): DDP(ORTModule(MLP()))
with torch's AdamW, its process group from ``ort_trainer.init_process_group``, its state (a dict of objects) saved
every ``--save-every`` steps by an asynchronous `CheckpointManager` and restored at start.

``--kill-step k``: the rank whose agent runs with ``ELASTIC_NODE=<--kill-node>`` SIGKILLs itself once after step k
(and its save); a marker file in ``--out`` keeps it to the first incarnation. Every rank writes its final weights,
AdamW moments and losses to ``--out/rank<r>.h5`` and a line per incarnation to ``--out/events.rank<r>``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ort_trainer
from ort_trainer import ORTModule, checkpoint
from ort_trainer.checkpoint import CheckpointManager
from tests.distributed import elastic_rank
from tests.models import MLP, mlp_batches


def main() -> None:
    args = elastic_rank.parse_args()
    ort_trainer.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(ORTModule(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    state = {"model": ddp, "optimizer": optimizer}
    manager = CheckpointManager(args.dir, keep_last=2, async_save=True)
    restored = manager.restore(state)
    start = restored.step if restored else 0
    elastic_rank.log_start(args, rank, start)
    losses = []
    for step, batch in enumerate(mlp_batches(args.steps, batch=12)[start:], start=start + 1):
        x, label = (t.chunk(world)[rank] for t in batch)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), label)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.5)
        optimizer.step()
        losses.append(loss.item())
        if step % args.save_every == 0:
            manager.save(state, step)
        elastic_rank.kill_once_after(args, step)
    manager.wait()
    moments = {
        f"{name}.{key}": optimizer.state[p][key]
        for name, p in model.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
    }
    out = {"weights": model.state_dict(), "moments": moments, "losses": torch.tensor(losses), "start": start}
    checkpoint.save(out, os.path.join(args.out, f"rank{rank}.h5"), overwrite=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
