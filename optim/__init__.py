"""Optimizers of ort_trainer: legacy-compatible configs and their update rules over flat buffers.

`AdamConfig`, `LambConfig` and `SGDConfig` say what to optimize with (legacy ORTTrainer names and
defaults, parameter groups); `FlatOptimizer` runs that rule in place over the trainer's flat
parameter buffer described by a `FlatLayout`; `lr_scheduler` holds the warmup LR schedules.

Modules: ``config`` (the configs), ``_flat_optimizer`` (``FlatOptimizer``) over ``_updates`` (the update rules on
slices), ``layout`` (``FlatLayout``), ``lr_scheduler``, ``state`` (legacy optimizer-state records and step
counters), ``torch_format`` (torch's optimizer format, both ways).
"""

from . import lr_scheduler
from ._flat_optimizer import FlatOptimizer
from .config import AdamConfig, DecayMode, LambConfig, SGDConfig
from .layout import FlatLayout, ParamSlot

__all__ = [
    "AdamConfig",
    "DecayMode",
    "FlatLayout",
    "FlatOptimizer",
    "LambConfig",
    "ParamSlot",
    "SGDConfig",
    "lr_scheduler",
]
