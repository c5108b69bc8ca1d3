"""One rank of the elastic-restart test (issue S item 8), started by a torchrun agent.

Trains the MLP with ZeRO-1 on this rank's shard for ``--steps`` steps, saving through an asynchronous
`CheckpointManager` every ``--save-every`` steps after ``restore()``. With ``--kill-step k`` the rank
whose agent runs with ``ELASTIC_NODE=<--kill-node>`` SIGKILLs itself once after step k (and its save):
a marker file in ``--out`` makes it happen in the first incarnation only. At the end every rank writes
its weights, optimizer state, step and the losses it computed to ``--out/rank<r>.h5``, plus a line per
incarnation to ``--out/events.rank<r>`` (restored step, restart count).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from ort_trainer.checkpoint import CheckpointManager
from tests.models import MLP, MLP_DESC, mlp_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="the CheckpointManager's directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--kill-node", default="B")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for stacks before a timeout kill
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(100 + rank)  # different initial weights per rank: rank 0's are broadcast
    options = {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}
    config = optim.AdamConfig(lr=0.02, lambda_coef=0.01, max_norm_clip=0.5)
    trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy, options=options)
    manager = CheckpointManager(args.dir, keep_last=2, async_save=True)
    restored = manager.restore(trainer)
    start = restored.step if restored else 0
    with open(os.path.join(args.out, f"events.rank{rank}"), "a") as f:
        restart, node = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("ELASTIC_NODE")
        f.write(f"start restored={start} restart={restart} node={node} pid={os.getpid()}\n")
    marker = os.path.join(args.out, "killed")
    losses = []
    for step, batch in enumerate(mlp_batches(args.steps, batch=12)[start:], start=start + 1):
        x, label = (t.chunk(world)[rank] for t in batch)
        losses.append(trainer.train_step(x, label).item())
        if step % args.save_every == 0:
            manager.save(trainer, step)
        if step == args.kill_step and os.environ.get("ELASTIC_NODE") == args.kill_node and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
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
