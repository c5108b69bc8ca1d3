"""One rank of tests/distributed/test_dropout_ranks.py: ZeRO-1 data parallel with dropout 0.1.

``full``: an uninterrupted run of STEPS steps, then (a second trainer) SPLIT steps saved to ``ck.ortcp``
(one shared path), and one step of a third trainer on the same batch on every rank (its losses show
whether the ranks drew different masks). ``resume``: a new trainer loads the save and runs the rest.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.dropout_worker import DropoutMLP, batches

STEPS, SPLIT = 4, 2


def make_trainer(seed: int) -> ORTTrainer:
    torch.manual_seed(seed)
    options = {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}
    desc = {"inputs": [("x", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    return ORTTrainer(
        DropoutMLP(), desc, optim.AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy, options=options
    )


def run(trainer: ORTTrainer, rank: int, start: int, stop: int) -> list[float]:
    return [trainer.train_step(*(t.chunk(2)[rank] for t in b)).item() for b in batches("mlp")[start:stop]]


def main(phase: str, folder: str) -> None:
    out, rank = Path(folder), int(os.environ["RANK"])
    if phase == "full":
        full = make_trainer(rank)  # other init seeds per rank: rank 0's weights and seed win
        losses = run(full, rank, 0, STEPS)
        first = make_trainer(rank)
        losses_first = run(first, rank, 0, SPLIT)
        first.save_checkpoint(out / "ck.ortcp")
        same_batch = make_trainer(rank).train_step(*batches("mlp")[0]).item()
        state = {"weights": full.state_dict(pytorch_format=True), "losses": torch.tensor(losses)}
        state |= {"first": torch.tensor(losses_first), "same_batch": same_batch, "seed": full.train_step_info.seed}
    else:
        resumed = make_trainer(rank + 50)
        resumed.load_checkpoint(checkpoint.manifest_path(out / "ck.ortcp"))
        losses = run(resumed, rank, SPLIT, STEPS)
        state = {"weights": resumed.state_dict(pytorch_format=True), "losses": torch.tensor(losses)}
    checkpoint.save(state, out / f"{phase}-rank{rank}.h5", overwrite=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
