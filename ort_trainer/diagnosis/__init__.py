"""Why a step failed, said in the user's terms: input and label checks.

- ``_input_checks``: input tensors, labels and ONNX inputs/outputs against the model description, and
  explanations of ORT/trace failures that name the offending input (ONNX Runtime's native log noise is kept
  quiet by ``runtime._native_logs``).
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

__all__ = [
    "LabelSpec",
    "check_input_tensors",
    "check_labels",
    "check_onnx_io",
    "describe_tensor",
    "explain_run_errors",
    "find_label_inputs",
    "label_range_message",
]
