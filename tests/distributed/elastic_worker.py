"""One rank of the elastic-restart test (issue S item 8), started by a torchrun agent.

Trains the MLP with ZeRO-1 on this rank's shard for ``--steps`` steps, saving through an asynchronous
`CheckpointManager` every ``--save-every`` steps after ``restore()``. With ``--kill-step k`` the rank
whose agent runs with ``ELASTIC_NODE=<--kill-node>`` SIGKILLs itself once after step k (and its save):
a marker file in ``--out`` makes it happen in the first incarnation only. At the end every rank writes
its weights, optimizer state, step and the losses it computed to ``--out/rank<r>.h5``, plus a line per
incarnation to ``--out/events.rank<r>`` (restored step, restart count).
"""

from __future__ import annotations

import os

import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from ort_trainer.checkpoint import CheckpointManager
from tests.distributed import elastic_rank
from tests.models import MLP, MLP_DESC, mlp_batches


def main() -> None:
    args = elastic_rank.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(100 + rank)  # different initial weights per rank: rank 0's are broadcast
    options = {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}
    config = optim.AdamConfig(lr=0.02, lambda_coef=0.01, max_norm_clip=0.5)
    trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy, options=options)
    manager = CheckpointManager(args.dir, keep_last=2, async_save=True)
    restored = manager.restore(trainer)
    start = restored.step if restored else 0
    elastic_rank.log_start(args, rank, start)
    losses = []
    for step, batch in enumerate(mlp_batches(args.steps, batch=12)[start:], start=start + 1):
        x, label = (t.chunk(world)[rank] for t in batch)
        losses.append(trainer.train_step(x, label).item())
        if step % args.save_every == 0:
            manager.save(trainer, step)
        elastic_rank.kill_once_after(args, step)
    manager.wait()
    state = {
        "weights": trainer.state_dict(pytorch_format=True),
        "optimizer": trainer.state_dict()["optimizer"],
        "losses": torch.tensor(losses),
        "start": start,
        "train_step_info": trainer.train_step_info.state_dict(),
    }
    checkpoint.save(state, os.path.join(args.out, f"rank{rank}.h5"), overwrite=True)
    trainer.close()


if __name__ == "__main__":
    main()
