"""ort_trainer: train PyTorch or ONNX models on ONNX Runtime, with checkpoints you can trust.

``from ort_trainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, optim, amp, checkpoint``
"""

import amp
import checkpoint
import optim

from .options import ORTTrainerOptions
from .train_step_info import TrainStepInfo
from .trainer import ORTTrainer

__all__ = ["ORTTrainer", "ORTTrainerOptions", "TrainStepInfo", "amp", "checkpoint", "optim"]
__version__ = "0.1.0"
