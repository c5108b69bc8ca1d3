"""ort_trainer: train PyTorch or ONNX models on ONNX Runtime, with checkpoints you can trust.

``from ort_trainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, optim, amp, checkpoint``

One installed import namespace: the subpackages ``ort_trainer.checkpoint``, ``ort_trainer.optim`` and
``ort_trainer.amp`` live in the repository's top-level ``checkpoint/``, ``optim/`` and ``amp/``
folders (mapped by ``package_dir`` in ``setup.py``).
"""

from . import amp, checkpoint, optim
from ._state import StateDictOptions
from .config import ORTTrainerOptions
from .train_step_info import TrainStepInfo
from .trainer import ORTTrainer

__all__ = ["ORTTrainer", "ORTTrainerOptions", "StateDictOptions", "TrainStepInfo", "amp", "checkpoint", "optim"]
__version__ = "0.1.0"
