"""Run in fresh processes by the resume tests.

``first``: for each optimizer, an uninterrupted run of STEPS steps, and a run of SPLIT steps that saves a
checkpoint. ``resume``: for each optimizer, a brand-new trainer loads that checkpoint and runs the rest.
Each run dumps its final state (and losses) with `checkpoint.save` for the test to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.models import MLP, MLP_DESC, mlp_batches

STEPS, SPLIT = 12, 6  # SPLIT is a gradient-accumulation boundary (accumulation = 2)
CONFIGS = {
    "adam": lambda: optim.AdamConfig(lr=0.02, lambda_coef=0.01),
    "lamb": lambda: optim.LambConfig(lr=0.02, lambda_coef=0.01),
    "sgd": lambda: optim.SGDConfig(lr=0.1),
}


def make_trainer(name: str) -> ORTTrainer:
    torch.manual_seed(0)
    scheduler = optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=STEPS, warmup=0.3)
    options = {
        "lr_scheduler": scheduler,
        "batch": {"gradient_accumulation_steps": 2},
        "debug": {"deterministic_compute": True},
    }
    return ORTTrainer(MLP(), MLP_DESC, CONFIGS[name](), loss_fn=torch.nn.functional.cross_entropy, options=options)


def run(trainer: ORTTrainer, start: int, stop: int, dump: Path, save: Path | None = None) -> None:
    losses = [trainer.train_step(*batch).item() for batch in mlp_batches(stop)[start:]]
    if save is not None:
        trainer.save_checkpoint(save, user_dict={"losses": losses})
    state = trainer.state_dict()
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    state["lr"] = trainer.options.lr_scheduler.get_last_lr()[0]
    checkpoint.save(state, dump, overwrite=True)


def main(phase: str, folder: str) -> None:
    out = Path(folder)
    for name in CONFIGS:
        if phase == "first":
            run(make_trainer(name), 0, STEPS, out / f"{name}-full.h5")
            run(make_trainer(name), 0, SPLIT, out / f"{name}-first.h5", save=out / f"{name}.ortcp")
        else:
            trainer = make_trainer(name)
            user = trainer.load_checkpoint(out / f"{name}.ortcp")
            if len(user["losses"]) != SPLIT:
                raise SystemExit(f"unexpected user_dict {user}")
            run(trainer, SPLIT, STEPS, out / f"{name}-resumed.h5")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
