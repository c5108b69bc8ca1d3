"""The ONNX graphs of a training run: from a torch module to the graph ONNX Runtime trains.

* ``_export``: TorchScript export of the module (with the loss) and the ONNX-name <-> torch-name map;
  ``_forward`` binds ``model_desc`` inputs to ``forward()`` by name for the export; ``_names``: canonical
  parameter names (without the prefixes of DDP, ``torch.compile``, activation checkpointing);
* ``_weightless``: graphs without weights (model state travels through the build as shapes only);
* ``_symbolics`` / ``_ctc``: exporter symbolics for aten ops torch cannot export (``ctc_loss`` unrolled);
  ``_unsupported``: clear errors for unexportable ops with a known way out; ``_trace_errors``: why tracing the
  first step failed, in the user's words;
* ``_scaled_sum``: ``ScaledSum`` (CUDA/ROCm-only) back into ``Mul`` + ``Add`` for CPU sessions;
* ``_passes``: small passes the gradient builder needs (optional outputs, BatchNorm statistics).
* ``_gradient_fixes``: work-arounds for ONNX Runtime gradient-builder bugs that gave wrong gradients.
* ``_embedding``, ``_no_gradient``, ``_label_smoothing``: the backward torch would run where the exported
  forward alone does not say it (padding rows, ``detach``/``no_grad``, label smoothing), or a clear refusal.
* ``_mixed_precision`` / ``_fp16_support``: the onnxblock engine's fp16 graph, and which ops a provider runs in
  float16 or bfloat16 (both engines).
* ``rewrites``: CPU speed rewrites that keep the math (each tested against PyTorch's gradients).
* ``autograd``: the autograd engine's graphs: PyTorch's own forward/backward exported for stock onnxruntime.

``ort_trainer.engine`` assembles these into sessions; nothing here runs a session for training.
"""

from __future__ import annotations

from ._export import export_torch_model, onnx_model_parameters
from ._forward import bind_forward_inputs, eval_outputs, model_input_names
from ._fp16_support import model_op_types, provider_fp16_support, provider_low_precision_support
from ._gradient_fixes import expand_where_inputs, forget_unnamed_dims
from ._mixed_precision import convert_to_mixed_precision, strip_loss_scaling
from ._names import KeyMatcher, canonical_name, outer_module
from ._no_gradient import unseal_no_gradient_copies
from ._passes import BatchNormStats, add_optional_outputs, strip_batchnorm_statistics, surface_batchnorm_statistics
from ._scaled_sum import unfuse_scaled_sum
from ._trace_errors import explain_trace_failure
from ._weightless import copy_without_data, shells_to_inputs, strip_data, with_values
from .rewrites import apply_forward_rewrites, apply_training_rewrites

__all__ = [
    "BatchNormStats",
    "KeyMatcher",
    "add_optional_outputs",
    "apply_forward_rewrites",
    "apply_training_rewrites",
    "bind_forward_inputs",
    "canonical_name",
    "convert_to_mixed_precision",
    "copy_without_data",
    "eval_outputs",
    "expand_where_inputs",
    "explain_trace_failure",
    "export_torch_model",
    "forget_unnamed_dims",
    "model_input_names",
    "model_op_types",
    "onnx_model_parameters",
    "outer_module",
    "provider_fp16_support",
    "provider_low_precision_support",
    "shells_to_inputs",
    "strip_batchnorm_statistics",
    "strip_data",
    "strip_loss_scaling",
    "surface_batchnorm_statistics",
    "unfuse_scaled_sum",
    "unseal_no_gradient_copies",
    "with_values",
]
