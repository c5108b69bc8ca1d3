"""Our files inside HF's ``checkpoint-N`` folders, and the random-number state, without pickle.

A folder holds HF's ``model.safetensors`` + ``config.json`` + ``trainer_state.json`` and ours:
``ort_trainer.ortcp`` (weights, AdamW moments, step counters, HF's LR-scheduler state and the groups'
rates; on W > 1 ranks a set of rank files + ``ort_trainer.ortcp.manifest.json``) and
``rng_state.ortcp`` (``rng_state_<rank>.ortcp`` on W > 1 ranks): Python, NumPy and torch generators,
read back when HF restores them (at the start of the resumed epoch, after skipping batches).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from ort_trainer import checkpoint

__all__ = ["TRAINER_FILE", "load_rng_state", "rng_file", "save_rng_state", "trainer_file"]

TRAINER_FILE = "ort_trainer.ortcp"


def trainer_file(folder: str | os.PathLike, world_size: int) -> Path:
    """What ``ORTTrainer.save_checkpoint`` gets, and what ``load_checkpoint`` gets back (a manifest on W > 1)."""
    path = Path(folder) / TRAINER_FILE
    return path if world_size <= 1 else checkpoint.manifest_path(path)


def rng_file(folder: str | os.PathLike, rank: int, world_size: int) -> Path:
    return Path(folder) / ("rng_state.ortcp" if world_size <= 1 else f"rng_state_{rank}.ortcp")


def save_rng_state(path: Path) -> None:
    """Python's, NumPy's legacy and torch's CPU (+ CUDA) generators, as HF's ``_save_rng_state`` keeps them."""
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.save(checkpoint.encode_user_dict(states), path, overwrite=True)


def load_rng_state(path: Path) -> bool:
    """Restore the generators from ``path``; False (nothing changed) when there is no such file."""
    if not path.is_file():
        return False
    states = checkpoint.decode_user_dict(checkpoint.load(path), source=str(path))
    version, internal, gauss = states["python"]
    python_state = (version, tuple(int(x) for x in internal), gauss)
    numpy_state = tuple(states["numpy"])
    cpu = torch.as_tensor(states["cpu"], dtype=torch.uint8)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.random.set_rng_state(cpu)
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in states["cuda"]])
    return True
