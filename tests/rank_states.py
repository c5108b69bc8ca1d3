"""Rank states for checkpoint-set tests: a full single-process state, exact comparison, per-rank saves."""

from __future__ import annotations

from pathlib import Path

import torch

from ort_trainer import checkpoint as C
from tests.builders import legacy_trainer_options

SHAPES = {"w1": (16, 14), "b1": (12,), "w2": (12, 8), "b2": (8,), "scale": ()}


FLAT = ["w1", "b1", "w2", "b2", "scale"]


def full_state(optimizer: str = "AdamOptimizer", seed: int = 0, shapes: dict | None = None) -> dict:
    """A single-process state as ORTTrainer.state_dict() returns it (plus a frozen weight)."""
    g = torch.Generator().manual_seed(seed)
    shapes = SHAPES if shapes is None else shapes
    model = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    model["frozen.emb"] = torch.randn(4, 3, generator=g)
    opt: dict = {}
    if optimizer != "SGDOptimizer":
        for n, s in shapes.items():
            opt[n] = {"Moment_1": torch.randn(s, generator=g), "Moment_2": torch.rand(s, generator=g)}
            if optimizer == "AdamOptimizer":
                opt[n]["Update_Count"] = torch.tensor([9], dtype=torch.int64)
    if optimizer == "LambOptimizer":
        opt["shared_optimizer_state"] = {"Step": torch.tensor([9], dtype=torch.int64)}
    return {
        "model": {"full_precision": model},
        "optimizer": opt,
        "trainer_options": legacy_trainer_options(optimizer_name=optimizer),
        "train_step_info": {"optimization_step": 8, "step": 16},
        "lr_scheduler": {"last_step": 8, "base_lr": 0.001},
        "loss_scaler": {"loss_scale": 1024.0, "stable_steps": 3},
        "user_dict": {"epoch": 2, "note": "hello"},
    }


def assert_same(expected, got, where="root"):
    """Exact equality: same python types and keys, tensors with the same dtype, shape and bits."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), where
        a, b = expected.contiguous().reshape(-1), got.contiguous().reshape(-1)
        assert a.view(torch.uint8).equal(b.view(torch.uint8)), where
        return
    assert type(got) is type(expected), f"{where}: {type(got)} != {type(expected)}"
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), f"{where}: {sorted(got)} != {sorted(expected)}"
        for key in expected:
            assert_same(expected[key], got[key], f"{where}/{key}")
    else:
        assert got == expected, where


def save_ranks(states, folder: Path, stem: str = "ckpt.ortcp") -> list[Path]:
    paths = []
    for state in states:
        opts = state["trainer_options"]
        path = C.rank_checkpoint_path(folder / stem, opts["world_rank"], opts["world_size"])
        C.save(state, path)
        paths.append(path)
    return paths
