"""ort_trainer: train PyTorch or ONNX models on ONNX Runtime, with checkpoints you can trust.

``from ort_trainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, optim, amp, checkpoint``

One installed import namespace: the subpackages ``ort_trainer.checkpoint``, ``ort_trainer.optim`` and
``ort_trainer.amp`` live in the repository's top-level ``checkpoint/``, ``optim/`` and ``amp/``
folders (mapped by ``package_dir`` in ``setup.py``; found by ``_package.source_tree`` when Python runs in a
source checkout). The names below are imported on first use, so ``import ort_trainer`` alone does not
load torch or ONNX Runtime (the checkpoint command line starts in a fraction of torch's import time).
Logs go to the ``ort_trainer`` logger (see ``docs/logging.md``).

Rooms (docs/architecture.md has the floor plan): ``trainer`` (``ORTTrainer``, the facade),
``train_step_info`` (``TrainStepInfo``), ``config`` (options, model description), ``graph`` (torch module ->
training graph), ``diagnosis`` (failures in the user's terms), ``engine`` (running the graphs, ``TrainerState``),
``_state`` (state dicts and checkpoints in and out), ``parallel`` (Megatron), ``module`` (``ORTModule``, the
torch.compile backend), ``hf`` (the Hugging Face ``Trainer``), ``export`` (training artifacts for any ONNX
Runtime: docs/anywhere.md), ``_package`` (import-time setup).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _package

_package.install(__file__)
_package.configure_from_env()

if TYPE_CHECKING:  # the lazily imported names, for type checkers and IDEs
    from . import amp, checkpoint, optim
    from ._state import StateDictOptions
    from .config import ORTTrainerOptions
    from .engine import init_process_group
    from .export import ArtifactRunner, export_training, load_training_state
    from .module import ORTModule
    from .train_step_info import TrainStepInfo
    from .trainer import ORTTrainer

__all__ = [
    "ArtifactRunner",
    "ORTModule",
    "ORTTrainer",
    "ORTTrainerOptions",
    "StateDictOptions",
    "TrainStepInfo",
    "amp",
    "checkpoint",
    "export_training",
    "init_process_group",
    "load_training_state",
    "optim",
]
__version__ = "0.1.0"

_LAZY = {
    "ORTModule": ".module",
    "ORTTrainer": ".trainer",
    "ORTTrainerOptions": ".config",
    "StateDictOptions": "._state",
    "TrainStepInfo": ".train_step_info",
    "init_process_group": ".engine",
    "ArtifactRunner": ".export",
    "export_training": ".export",
    "load_training_state": ".export",
}
_SUBPACKAGES = ("amp", "checkpoint", "optim")


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562) and keep it as a module attribute."""
    if name in _SUBPACKAGES:
        value: Any = importlib.import_module(f".{name}", __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module 'ort_trainer' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
