"""Launching tests.dist_worker ranks and the single-process run they are compared with."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ort_trainer import checkpoint
from tests.dist_worker import make_trainer
from tests.models import mlp_batches
from tests.ranks import run_ranks

TIMEOUT_S = 240


def launch(world: int, out: Path, *args) -> list[dict]:
    """Run `world` ranks of tests.dist_worker; each writes its state to ``out/rank<r>.h5``."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(world, ["-m", "tests.dist_worker", "--out", str(out), *map(str, args)])
    return [checkpoint.load(out / f"rank{r}.h5") for r in range(world)]


def single_process(zero: int = 0, steps: int = 8, clip: bool = True, optimizer: str = "adam"):
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("RANK", None)
    trainer = make_trainer(0, clip, optimizer)
    torch.manual_seed(100)  # rank 0's initial weights
    from tests.models import MLP

    trainer.load_state_dict(MLP().state_dict())
    losses = [trainer.train_step(*batch).item() for batch in mlp_batches(steps, batch=12)]
    return trainer, losses


def assert_full_state_equal(got, expected, atol=2e-6):
    for name, value in expected["model"]["full_precision"].items():
        torch.testing.assert_close(got["model"]["full_precision"][name], value, atol=atol, rtol=1e-5)
    for name, entry in expected["optimizer"].items():
        for key, value in entry.items():
            torch.testing.assert_close(got["optimizer"][name][key], value, atol=atol, rtol=1e-5, msg=f"{name}/{key}")
    assert got["train_step_info"] == expected["train_step_info"]
