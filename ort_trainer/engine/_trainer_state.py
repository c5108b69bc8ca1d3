"""`TrainerState`: everything a trainer's state lives in, as one explicit object.

The trainer (``ORTTrainer``, a thin facade) owns one; the step (`engine._step`), the state dicts and
checkpoints (``ort_trainer._state``) read and update it. None of them reaches into the trainer's private
fields, and none of them imports ``trainer.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx
    import torch

    from ort_trainer.checkpoint.io import SaveScheduler
    from ort_trainer.config.model_desc import ModelDescription
    from ort_trainer.config.options import ORTTrainerOptions
    from ort_trainer.optim.config import OptimizerConfig
    from ort_trainer.runtime import DeviceSpec
    from ort_trainer.train_step_info import TrainStepInfo

    from ._build import Engine
    from ._distributed import DistributedContext
    from ._protocols import ModelParallel
    from ._store import ParamStore

__all__ = ["TrainerState"]


@dataclass(eq=False)
class TrainerState:
    """The parts of one trainer: what the user gave, the buffers, the graphs (once built), the counters."""

    options: ORTTrainerOptions
    optim_config: OptimizerConfig
    model_desc: ModelDescription  # typed (input/output dtypes) once the graphs are built
    loss_fn: Callable | None
    model: torch.nn.Module | onnx.ModelProto
    device: DeviceSpec
    store: ParamStore  # weights, optimizer, frozen state: complete from construction on
    train_step_info: TrainStepInfo
    dist: DistributedContext | None
    engine: Engine | None = None  # None until the graphs are built on the first step
    checkpoint_io: SaveScheduler | None = None  # background writer of asynchronous saves, created on the first save
    closed: bool = False
    engine_name: str = "onnxblock"  # the graph source chosen at construction (`_sources.choose_engine`)
    horizontal: ModelParallel | None = None  # Megatron: this rank's slice, groups and specs (docs/megatron.md)

    def wait_for_snapshot(self) -> None:
        """An asynchronous save may still be copying the live buffers: wait for that copy (and report its error)."""
        if self.checkpoint_io is not None:
            self.checkpoint_io.check()
            self.checkpoint_io.wait_for_snapshot()
