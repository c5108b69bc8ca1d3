"""Why tracing the first step failed, named in our words (the model and the loss re-run eagerly).

Lives in `graph/` because it drives the same forward binding the exporter uses (`_forward`); the message
helpers come from `diagnosis`, which sits below `graph` (imports go graph -> diagnosis, never back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.diagnosis import describe_tensor, label_range_message

from ._forward import (
    OutputContractError,
    OutputContractTypeError,
    bind_forward_inputs,
    model_input_names,
    module_for_export,
)

__all__ = ["explain_trace_failure"]

_TORCH_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)  # what torch raises on bad inputs


def explain_trace_failure(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    desc: ModelDescription,
    inputs: Sequence[torch.Tensor],
    error: Exception,
) -> Exception | None:
    """Why tracing the first step failed, as an error naming the input at fault; None: not an input problem.

    The model and the loss run again eagerly (on a copy, or on the restored module) to tell a model
    that rejects an input from a loss that rejects the label from an exporter problem.
    """
    if isinstance(error, OutputContractError | OutputContractTypeError) or not isinstance(error, _TORCH_ERRORS):
        return None
    names = desc.input_names
    dtype_problem = _float_dtype_mismatch(model, names, inputs)
    if dtype_problem is not None:
        return TypeError(f"{dtype_problem} (the first step failed with: {error})")
    model_names = model_input_names(desc, loss_fn)
    with module_for_export(model, warn=False) as module, torch.no_grad():
        binding = bind_forward_inputs(module, model_names)
        module.train()
        try:
            preds = binding.call(module, inputs[: len(model_names)])
        except _TORCH_ERRORS as eager:
            listed = ", ".join(f"{n} ({describe_tensor(t)})" for n, t in zip(model_names, inputs, strict=False))
            return ValueError(f"{binding.where}() failed on the inputs {listed}: {eager}")
        if loss_fn is None:
            return None
        try:
            loss_fn(preds, inputs[-1])
        except _TORCH_ERRORS as eager:
            return _explain_loss_failure(loss_fn, preds, names[-1], inputs[-1], eager)
    return None


def _float_dtype_mismatch(model: torch.nn.Module, names: Sequence[str], inputs: Sequence[torch.Tensor]) -> str | None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return None
    (expected,) = dtypes
    wrong = [
        f"input {name!r} has dtype {tensor.dtype}, but the model's parameters are {expected}"
        for name, tensor in zip(names, inputs, strict=True)
        if tensor.is_floating_point() and tensor.dtype != expected
    ]
    if not wrong:
        return None
    return "; ".join(wrong) + f": pass floating-point inputs as {expected} (e.g. tensor.to({expected}))"


def _classification_loss(loss_fn: Callable) -> tuple[str, int] | None:
    """(name, ignore_index) of PyTorch's class-index losses; None for any other loss_fn."""
    functional = {torch.nn.functional.cross_entropy: "cross_entropy", torch.nn.functional.nll_loss: "nll_loss"}
    with contextlib.suppress(TypeError):  # an unhashable callable is no function of ours
        if loss_fn in functional:
            return functional[loss_fn], -100
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss | torch.nn.NLLLoss):
        return type(loss_fn).__name__, int(loss_fn.ignore_index)
    return None


def _explain_loss_failure(loss_fn: Callable, preds, name: str, label: torch.Tensor, error: Exception) -> Exception:
    known = _classification_loss(loss_fn)
    if known is not None and isinstance(preds, torch.Tensor) and preds.dim() >= 1:
        loss_name, ignore_index = known
        classes = preds.shape[1] if preds.dim() >= 2 else preds.shape[0]
        if label.is_floating_point() and label.shape != preds.shape:
            return TypeError(
                f"input {name!r} has dtype {label.dtype} and shape {list(label.shape)}, but {loss_name} expects "
                f"integer class indices (torch.int64) in [0, {classes - 1}], or float class probabilities of the "
                f"prediction's shape {list(preds.shape)}"
            )
        if not label.is_floating_point():
            message = label_range_message(name, label, classes, ignore_index)
            if message is not None:
                return ValueError(message)
    predicted = describe_tensor(preds) if isinstance(preds, torch.Tensor) else type(preds).__name__
    hint = " (a classification loss needs integer class indices, e.g. torch.int64)" if label.is_floating_point() else ""
    return ValueError(
        f"loss_fn failed on the model's prediction ({predicted}) and input {name!r} ({describe_tensor(label)}){hint}: "
        f"{error}"
    )
