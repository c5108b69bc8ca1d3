"""Run in fresh processes by test_interop_dcp: DCP save / load with the trainer as a ``Stateful``.

``first``: an uninterrupted run of STEPS steps, and a run of SPLIT steps that ``dcp.save``s {"trainer": ...}.
``resume``: a brand-new, unbuilt trainer (other initial weights) is ``dcp.load``ed and runs the rest.
Each run dumps its final state and losses with `checkpoint.save` for the test to compare.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.models import MLP, MLP_DESC, mlp_batches

STEPS, SPLIT = 10, 4


def make_trainer(seed: int) -> ORTTrainer:
    torch.manual_seed(seed)
    options = {
        "lr_scheduler": optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=STEPS, warmup=0.3),
        "batch": {"gradient_accumulation_steps": 2},
        "debug": {"deterministic_compute": True},
    }
    config = optim.AdamConfig(lr=0.02, lambda_coef=0.01)
    return ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy, options=options)


def run(trainer: ORTTrainer, start: int, stop: int) -> list[float]:
    return [trainer.train_step(*batch).item() for batch in mlp_batches(stop)[start:]]


def dump(trainer: ORTTrainer, losses: list[float], path: Path) -> None:
    state = trainer.state_dict()
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    checkpoint.save(state, path, overwrite=True)


def main(phase: str, folder: str) -> None:
    out = Path(folder)
    warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
    if phase == "first":
        full = make_trainer(0)
        dump(full, run(full, 0, STEPS), out / "full.h5")
        first = make_trainer(0)
        losses = run(first, 0, SPLIT)
        dcp.save({"trainer": first}, checkpoint_id=out / "dcp")
        dump(first, losses, out / "first.h5")
    else:
        resumed = make_trainer(123)  # unbuilt, other weights: everything must come from the checkpoint
        dcp.load({"trainer": resumed}, checkpoint_id=out / "dcp")
        if resumed.is_built:
            raise SystemExit("dcp.load built the trainer")
        dump(resumed, run(resumed, SPLIT, STEPS), out / "resumed.h5")


if __name__ == "__main__":
    main(*sys.argv[1:])
