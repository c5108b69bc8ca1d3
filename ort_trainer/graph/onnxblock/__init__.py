"""The onnxblock engine's graphs: the TorchScript export and the forward graph onnxruntime-training differentiates.

Half of the onnxblock wing (its engine side: ``engine.onnxblock``; Megatron's segments: ``engine.onnxblock.parallel``).
Nothing outside the wing imports it.

* ``_export``: TorchScript export of the module (with the loss) and the ONNX-name <-> torch-name map;
* ``_symbolics`` / ``_ctc``: exporter symbolics for aten ops torch cannot export (``ctc_loss`` unrolled);
  ``_unsupported``: clear errors for unexportable ops with a known way out;
* ``_embedding``, ``_no_gradient``, ``_label_smoothing``: the backward torch would run where the exported
  forward alone does not say it (padding rows, ``detach``/``no_grad``, label smoothing), or a clear refusal;
* ``_passes``: small passes the gradient builder needs (optional outputs, BatchNorm statistics);
* ``_gradient_fixes``: work-arounds for ONNX Runtime gradient-builder bugs that gave wrong gradients;
* ``_scaled_sum``: ``ScaledSum`` (CUDA/ROCm-only) back into ``Mul`` + ``Add`` for CPU sessions;
* ``_mixed_precision``: the fp16 forward graph (the provider's fp16 kernels: ``graph._fp16_support``);
* ``rewrites``: CPU speed rewrites that keep the math (each tested against PyTorch's gradients).
"""

from __future__ import annotations

from ._export import export_torch_model
from ._gradient_fixes import expand_where_inputs, forget_unnamed_dims
from ._mixed_precision import convert_to_mixed_precision, strip_loss_scaling
from ._no_gradient import unseal_no_gradient_copies
from ._passes import BatchNormStats, add_optional_outputs, strip_batchnorm_statistics, surface_batchnorm_statistics
from ._scaled_sum import unfuse_scaled_sum
from .rewrites import apply_forward_rewrites, apply_training_rewrites

__all__ = [
    "BatchNormStats",
    "add_optional_outputs",
    "apply_forward_rewrites",
    "apply_training_rewrites",
    "convert_to_mixed_precision",
    "expand_where_inputs",
    "export_torch_model",
    "forget_unnamed_dims",
    "strip_batchnorm_statistics",
    "strip_loss_scaling",
    "surface_batchnorm_statistics",
    "unfuse_scaled_sum",
    "unseal_no_gradient_copies",
]
