"""Training artifacts: one self-contained training step for any ONNX Runtime (docs/anywhere.md).

``export_training`` writes a folder that Python onnxruntime, onnxruntime-node and onnxruntime-web can train with
(no onnxruntime-training): the training-step graph (forward, backward, clipping, optimizer update), the eval graph,
the state in safetensors and a manifest. ``load_training_state`` reads a state a driver saved back, for
``ORTTrainer`` or a plain PyTorch module.

* ``_graphs``: the autograd engine's training and eval graphs of a trainer's model, symbolic dims kept;
* ``_builder`` / ``_updates`` / ``_step_graph``: clipping and the optimizer updates as standard ONNX ops, appended
  to the training graph;
* ``_manifest`` / ``_state_file``: the manifest and the state file, written and checked; ``_errors``:
  `ArtifactError`, what a bad one raises;
* ``_export``: `export_training`;
* ``_driver``: `ArtifactRunner`, the reference driver in Python onnxruntime;
* ``_load``: `load_training_state`, `TrainingState`, the way back into ``ORTTrainer`` and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._driver import ArtifactRunner
    from ._errors import ArtifactError
    from ._export import export_training
    from ._load import TrainingState, is_training_state, load_training_state

__all__ = [
    "ArtifactError",
    "ArtifactRunner",
    "TrainingState",
    "export_training",
    "is_training_state",
    "load_training_state",
]

# imported on first use: the checkpoint command line reads artifact states (`_load`) without torch or onnx
_LAZY = {
    "ArtifactError": "._errors",
    "ArtifactRunner": "._driver",
    "TrainingState": "._load",
    "export_training": "._export",
    "load_training_state": "._load",
    "is_training_state": "._load",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ort_trainer.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
