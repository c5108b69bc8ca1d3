"""One rank's saver for the SIGKILL tests (tests/checkpoint/test_checkpoint_set_kills.py).

``python -m tests.checkpoint.kill_saver RANK WORLD PATH MODE`` imports the library once, then on each ``go PORT``
line forks a child that joins a fresh process group on PORT (when WORLD > 1), builds a trainer,
resumes from the checkpoint at PATH if there is one, and trains + saves to PATH with
``overwrite=True`` (MODE ``sync`` or ``async``) until it is killed. The
child prints ``saved <rank> <step>`` once its first save is complete. ``reap PID`` answers the wait
status. Forking saves an interpreter start (torch, onnxruntime) per round.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.models import MLP, MLP_DESC, mlp_batches

HIDDEN = 20_000  # ~0.5M parameters: a rank file of a few MB, so kills land inside writes too


def _child(rank: int, world: int, port: int, path: str, mode: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)
    options = {"distributed": {"world_rank": rank, "world_size": world}}
    if world > 1:
        options["distributed"]["deepspeed_zero_optimization"] = {"stage": 1}
    trainer = ORTTrainer(
        MLP(hidden=HIDDEN),
        MLP_DESC,
        optim.AdamConfig(lr=1e-3),
        loss_fn=torch.nn.functional.cross_entropy,
        options=options,
    )
    published = checkpoint.manifest_path(path) if world > 1 else Path(path)
    if published.exists():  # resume: the steps of the run only go forward, killed or not
        trainer.load_checkpoint(published)
    batches = mlp_batches(4, batch=4 * world)
    extra = {"async_save": True} if mode == "async" else {}
    first = True
    while True:
        x, label = batches[trainer.train_step_info.step % len(batches)]
        trainer.train_step(x.chunk(world)[rank], label.chunk(world)[rank])
        handle = trainer.save_checkpoint(path, overwrite=True, **extra)
        if first:
            if handle is not None and hasattr(handle, "wait"):
                handle.wait()
            print(f"saved {rank} {trainer.train_step_info.step}", flush=True)
            first = False


def main() -> None:
    rank, world, path, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    print("ready", flush=True)
    for line in sys.stdin:
        command, arg = line.split()
        if command == "go":
            pid = os.fork()
            if pid == 0:
                try:
                    _child(rank, world, int(arg), path, mode)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(3)
            print(f"pid {pid}", flush=True)
        else:
            print(f"status {os.waitpid(int(arg), 0)[1]}", flush=True)


if __name__ == "__main__":
    main()
