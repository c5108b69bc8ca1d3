"""Our files inside HF's ``checkpoint-N`` folders, and the random-number state, without pickle.

A folder holds HF's ``model.safetensors`` + ``config.json`` + ``trainer_state.json`` and ours:
``ort_trainer.ortcp`` (weights, AdamW moments, step counters, HF's LR-scheduler state and the groups'
rates; on W > 1 ranks a set of rank files + ``ort_trainer.ortcp.manifest.json``) and
``rng_state.ortcp`` (``rng_state_<rank>.ortcp`` on W > 1 ranks): Python, NumPy and torch generators,
read back when HF restores them (at the start of the resumed epoch, after skipping batches).

A save killed part-way (a preempted job) leaves its ``checkpoint-N`` incomplete: the weights without our
file, our temporary file, no or half of ``trainer_state.json`` (HF writes it last). `checkpoint_problem`
says what is missing; `newest_complete_checkpoint` is what ``resume_from_checkpoint=True`` resumes from.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from ort_trainer import checkpoint

__all__ = [
    "TRAINER_FILE",
    "TRAINER_STATE",
    "checkpoint_problem",
    "load_rng_state",
    "newest_complete_checkpoint",
    "rng_file",
    "save_rng_state",
    "saved_steps",
    "trainer_file",
]

TRAINER_FILE = "ort_trainer.ortcp"
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: written last by a save
_FOLDER = re.compile(r"^checkpoint-([0-9]+)$")  # transformers' PREFIX_CHECKPOINT_DIR, as get_last_checkpoint reads it
# what save_model leaves (save_pretrained, safetensors or not, sharded or not; a PEFT adapter)
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


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


def saved_steps(path: Path) -> tuple[int, int]:
    """(``step``, ``optimization_step``) stored in our checkpoint at ``path`` (a file or, on W > 1, a manifest).

    Reads only the counters (rank 0's file of a set); raises a ``CheckpointError`` for a file that is not
    a complete checkpoint.
    """
    if path.name.endswith(".manifest.json"):
        path = checkpoint.check_manifest(path, checksums=False).rank_paths()[0]
    info = checkpoint.load(path, "train_step_info")
    return int(info["step"]), int(info["optimization_step"])


def checkpoint_problem(folder: Path, world_size: int) -> str | None:
    """Why ``folder`` (a ``checkpoint-N``) cannot resume a run; None when its save completed."""
    match = _FOLDER.match(folder.name)
    if match is None or not folder.is_dir():
        return "not a checkpoint-N folder"
    state_file = folder / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {TRAINER_STATE} (a save writes it last)"
    except (OSError, ValueError) as error:
        return f"{TRAINER_STATE} is incomplete or unreadable ({error})"
    step = int(match.group(1))
    if not isinstance(state, dict) or state.get("global_step") != step:
        found = state.get("global_step") if isinstance(state, dict) else state
        return f"{TRAINER_STATE} has global_step {found!r}, not {step}"
    if not any((folder / name).is_file() for name in _WEIGHTS):
        return f"no model weights (none of {', '.join(_WEIGHTS[:2])}, ...)"
    ours = trainer_file(folder, world_size)
    if not ours.is_file():
        return f"no {ours.name} (the ORTTrainer state)"
    try:
        saved_steps(ours)
    except checkpoint.CheckpointError as error:
        return f"{ours.name} is not a complete checkpoint ({error})"
    for rank in range(world_size):
        if not rng_file(folder, rank, world_size).is_file():
            return f"no {rng_file(folder, rank, world_size).name}"
    return None


def newest_complete_checkpoint(output_dir: str | os.PathLike, world_size: int) -> tuple[Path | None, list[str]]:
    """The ``checkpoint-N`` of ``output_dir`` with the highest N whose save completed, and why newer ones were
    skipped (``"<folder>: <reason>"``)."""
    root = Path(output_dir)
    folders = [p for p in root.iterdir() if _FOLDER.match(p.name) and p.is_dir()] if root.is_dir() else []
    skipped = []
    for folder in sorted(folders, key=lambda p: int(p.name.split("-")[1]), reverse=True):
        problem = checkpoint_problem(folder, world_size)
        if problem is None:
            return folder, skipped
        skipped.append(f"{folder}: {problem}")
    return None, skipped
