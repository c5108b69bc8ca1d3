"""`StateOwner`: what the state-dict and checkpoint functions need from a trainer.

`_state` and `_checkpointing` work on this interface, not on the `ORTTrainer` class, so neither
imports `trainer.py` and the trainer imports both at module level (no import circle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import onnx
    import torch

    from ort_trainer.checkpoint.io import CheckpointIO
    from ort_trainer.engine._build import Engine
    from ort_trainer.engine._distributed import DistributedContext
    from ort_trainer.engine._store import ParamStore
    from ort_trainer.optim.config import OptimizerConfig

    from ..config.model_desc import ModelDescription
    from ..config.options import ORTTrainerOptions
    from ..train_step_info import TrainStepInfo

__all__ = ["StateOwner"]


class StateOwner(Protocol):
    """The trainer's parts that its state lives in (`ORTTrainer` satisfies this)."""

    options: ORTTrainerOptions
    optim_config: OptimizerConfig
    model_desc: ModelDescription
    loss_fn: Callable | None
    _model: torch.nn.Module | onnx.ModelProto
    _store: ParamStore  # weights, optimizer, frozen state: complete from construction on
    _engine: Engine | None  # None until the graphs are built on the first step
    _train_step_info: TrainStepInfo
    _dist: DistributedContext | None
    _checkpoint_io: CheckpointIO | None  # background writer of asynchronous saves, created on the first save
