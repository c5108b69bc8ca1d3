"""The ONNX graphs of a training run: what both engines' graphs share, and the two wings' graph halves.

* ``_names``: canonical parameter names (without the prefixes of DDP, ``torch.compile``, activation
  checkpointing); ``_forward`` binds ``model_desc`` inputs to ``forward()`` by name (both engines' traces);
* ``_trace_errors``: why tracing the first step failed, in the user's words; ``_module_checks``: what a module
  must not do for any graph (``Embedding(max_norm=...)``);
* ``_weightless``: graphs without weights (model state travels through a build as shapes only), and which
  initializers of a user-given ONNX model are its parameters;
* ``_fp16_support``: which ops a provider runs in float16 or bfloat16 (both engines' mixed precision);
* ``onnxblock``: the onnxblock engine's graphs (TorchScript export, passes, fp16 graphs, CPU rewrites);
* ``autograd``: the autograd engine's graphs: PyTorch's own forward/backward exported for stock onnxruntime.

``ort_trainer.engine`` assembles these into sessions; nothing here runs a session for training. The two
sub-packages are wings (docs/architecture.md): only their engine halves (and ``module/`` for ``autograd``)
import them.
"""

from __future__ import annotations

from ._forward import bind_forward_inputs, eval_outputs, model_input_names
from ._fp16_support import model_op_types, provider_fp16_support, provider_low_precision_support
from ._names import KeyMatcher, canonical_name, outer_module
from ._trace_errors import explain_trace_failure
from ._weightless import copy_without_data, onnx_model_parameters, shells_to_inputs, strip_data, with_values

__all__ = [
    "KeyMatcher",
    "bind_forward_inputs",
    "canonical_name",
    "copy_without_data",
    "eval_outputs",
    "explain_trace_failure",
    "model_input_names",
    "model_op_types",
    "onnx_model_parameters",
    "outer_module",
    "provider_fp16_support",
    "provider_low_precision_support",
    "shells_to_inputs",
    "strip_data",
    "with_values",
]
