"""Why a step failed, said in the user's terms: input and label checks, and quiet native logs.

- ``_input_checks``: input tensors, labels and ONNX inputs/outputs against the model description, and
  explanations of ORT/trace failures that name the offending input;
- ``_native_logs``: silence onnxruntime's native INFO chatter around calls that would print it.
"""

from ._input_checks import (
    LabelSpec,
    check_input_tensors,
    check_labels,
    check_onnx_io,
    describe_tensor,
    explain_run_errors,
    find_label_inputs,
    label_range_message,
)
from ._native_logs import NO_GRADIENT_NODE_SUFFIX, quiet_native_info_logs

__all__ = [
    "LabelSpec",
    "NO_GRADIENT_NODE_SUFFIX",
    "check_input_tensors",
    "check_labels",
    "check_onnx_io",
    "describe_tensor",
    "explain_run_errors",
    "find_label_inputs",
    "label_range_message",
    "quiet_native_info_logs",
]
