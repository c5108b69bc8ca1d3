"""The custom loop of ``tests/custom_loop.py`` as a process:
``python -m tests.checkpoint.custom_loop_worker RUN_DIR OUT``.

Restores the newest checkpoint of RUN_DIR if there is one, trains to the end with an asynchronous save every
2 steps (keep_last=2), printing ``step <n>`` after each step (the test kills it with SIGKILL part way), and
writes the final weights and optimizer state to OUT. ``--no-checkpoints`` runs the same loop uninterrupted.
"""

from __future__ import annotations

import sys
import time

import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointManager
from tests.custom_loop import STEPS, make_loop, state_of, train


def main(run_dir: str, out: str, checkpoints: bool, pause: float) -> None:
    torch.set_num_threads(1)
    loop = make_loop()
    manager = CheckpointManager(run_dir, keep_last=2, async_save=True) if checkpoints else None
    restored = manager.restore(state_of(loop)) if manager else None
    start = restored.step if restored else 0
    print(f"start {start}", flush=True)

    def after(step: int) -> None:
        if manager is not None and step % 2 == 0:
            manager.save(state_of(loop), step)
        print(f"step {step}", flush=True)
        time.sleep(pause)

    train(loop, start, STEPS, after_step=after)
    if manager is not None:
        manager.wait()
    checkpoint.save({"weights": dict(loop.model.state_dict()), "adam": loop.optimizer.state_dict()["state"][0]}, out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], args[1], "--no-checkpoints" not in sys.argv, 0.15 if "--slow" in sys.argv else 0.0)
