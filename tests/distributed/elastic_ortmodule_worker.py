"""One rank of the elastic-restart test of the custom loop (issue S item 8): DDP(ORTModule(MLP()))
with torch's AdamW, its process group from ``ort_trainer.init_process_group``, its state (a dict of objects) saved
every ``--save-every`` steps by an asynchronous `CheckpointManager` and restored at start.

``--kill-step k``: the rank whose agent runs with ``ELASTIC_NODE=<--kill-node>`` SIGKILLs itself once after step k
(and its save); a marker file in ``--out`` keeps it to the first incarnation. Every rank writes its final weights,
AdamW moments and losses to ``--out/rank<r>.h5`` and a line per incarnation to ``--out/events.rank<r>``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ort_trainer
from ort_trainer import ORTModule, checkpoint
from ort_trainer.checkpoint import CheckpointManager
from tests.models import MLP, mlp_batches


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
    with open(os.path.join(args.out, f"events.rank{rank}"), "a") as f:
        restart, node = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("ELASTIC_NODE")
        f.write(f"start restored={start} restart={restart} node={node} pid={os.getpid()}\n")
    marker = os.path.join(args.out, "killed")
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
        if step == args.kill_step and os.environ.get("ELASTIC_NODE") == args.kill_node and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
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
