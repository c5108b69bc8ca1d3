"""Clear errors for aten ops that the ONNX exporter cannot export and that have a known way out.

``torch.onnx`` says ``Exporting the operator 'aten::X' to ONNX opset version N is not supported``; for
ops that popular models reach, the error is raised again naming the op, the module that uses it and
what to do instead.
"""

from __future__ import annotations

import re

import torch

__all__ = ["explain_unsupported_op"]

_OP = re.compile(r"operator '(aten::[A-Za-z0-9_]+)'")


def _experts(model: torch.nn.Module) -> list[str]:
    """Experts modules (or else modules whose transformers config asks for ``grouped_mm`` experts)."""
    experts = [_label(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    configured = [
        _label(n, m)
        for n, m in model.named_modules()
        if getattr(getattr(m, "config", None), "_experts_implementation", None) == "grouped_mm"
    ]
    return (experts or configured)[:1]


def _label(name: str, module: torch.nn.Module) -> str:
    return f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


_HINTS = {
    "aten::_grouped_mm": (
        _experts,
        "the grouped_mm experts implementation of transformers' mixture-of-experts layers (torch._grouped_mm) has no "
        "ONNX export; build the model with experts_implementation='eager' (or 'batched_mm'): "
        "Config(..., experts_implementation='eager'), or model.set_experts_implementation('eager')",
    ),
}


def explain_unsupported_op(model: torch.nn.Module, error: Exception) -> Exception | None:
    """A ``NotImplementedError`` naming the op, the module and the way out; None for other errors."""
    match = _OP.search(str(error))
    if match is None or match.group(1) not in _HINTS:
        return None
    op = match.group(1)
    find, hint = _HINTS[op]
    where = find(model)
    used = f" (used by {where[0]})" if where else ""
    return NotImplementedError(f"cannot export the model to ONNX: {op}{used}: {hint}")
