"""The ONNX graphs of a training run: from a torch module to the graph ONNX Runtime trains.

* ``_export``: TorchScript export of the module (with the loss) and the ONNX-name <-> torch-name map;
  ``_forward`` binds ``model_desc`` inputs to ``forward()`` by name for the export.
* ``_passes``: small passes the gradient builder needs (optional outputs, BatchNorm statistics).
* ``_gradient_fixes``: work-arounds for ONNX Runtime gradient-builder bugs that gave wrong gradients.
* ``_embedding``, ``_no_gradient``, ``_label_smoothing``: the backward torch would run where the exported
  forward alone does not say it (padding rows, ``detach``/``no_grad``, label smoothing), or a clear refusal.
* ``_mixed_precision`` / ``_fp16_support``: the fp16/bf16 graph and which ops a provider runs in it.
* ``rewrites``: CPU speed rewrites that keep the math (each tested against PyTorch's gradients).

``ort_trainer.engine`` assembles these into sessions; nothing here runs a session for training.
"""

from __future__ import annotations

from .rewrites import apply_forward_rewrites, apply_training_rewrites

__all__ = ["apply_forward_rewrites", "apply_training_rewrites"]
