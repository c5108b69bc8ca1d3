"""The autograd engine's mixed precision on this provider: `autograd_precision` and `report_fallbacks`.

The graphs are PyTorch's mixed precision (`graph.autograd.Precision`: the step traced under ``torch.autocast``,
the backward from ``loss * loss_scale``), but autocast only makes sense where the provider has low-precision
kernels for the products it lowers. ONNX Runtime's CPU provider has float16 kernels for data movement and a
few ops (LayerNormalization, Max...), not for MatMul, Gemm, Add or Mul (probed, `graph._fp16_support`): an
autocast graph would run there as float32 kernels wrapped in inserted casts, slower than float32 and no
smaller. So, as the onnxblock engine does, the math stays float32 on such a provider and only the loss scaling
is added; on a provider with low-precision MatMul kernels (CUDA; a CPU build whose MLAS has them) the step is
traced under autocast. Ops of an autocast graph that the provider still lacks kernels for are named once in
the log (`report_fallbacks`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import onnx
import torch
from onnx import TensorProto

from ort_trainer.graph import provider_low_precision_support
from ort_trainer.graph.autograd import Precision

__all__ = ["autograd_precision", "report_fallbacks"]

_log = logging.getLogger("ort_trainer")
_DTYPES = {"float16": (torch.float16, TensorProto.FLOAT16), "bfloat16": (torch.bfloat16, TensorProto.BFLOAT16)}
_ELEM = {torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}
# the products autocast runs in low precision on every device (linear, matmul, bmm, addmm reach ONNX as these)
_PRODUCTS = (("", "MatMul", 13), ("", "Gemm", 13))


def autograd_precision(enabled: bool, dtype: str, providers: Sequence) -> Precision:
    """The `Precision` the autograd engine traces with: float32 without mixed precision; with it, the loss
    scaled, under ``torch.autocast(dtype)`` when the first provider runs ``dtype`` MatMul and Gemm kernels."""
    if not enabled:
        return Precision()
    if dtype not in _DTYPES:
        raise ValueError(f"mixed_precision.dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    torch_dtype, elem = _DTYPES[dtype]
    support = low_precision_support(providers, _PRODUCTS, elem)
    if all(support.values()):
        _log.info("mixed precision: the graphs compute in %s (torch.autocast), the loss is scaled", dtype)
        return Precision(torch_dtype, loss_scale=True)
    missing = sorted(op for (_, op), ok in support.items() if not ok)
    _log.info(
        "mixed precision: %s has no %s kernels for %s, so the math stays float32 and only the loss is scaled "
        "(as the onnxblock engine does on this provider)",
        _provider_name(providers),
        dtype,
        missing,
    )
    return Precision(None, loss_scale=True)


def low_precision_support(providers: Sequence, ops, elem_type: int) -> dict[tuple[str, str], bool]:
    """`graph.provider_low_precision_support` (a seam: tests make the CPU provider report kernels it lacks)."""
    return provider_low_precision_support(providers, ops, elem_type)


def report_fallbacks(model: onnx.ModelProto, precision: Precision, providers: Sequence) -> list[str]:
    """The op types that compute in the autocast dtype in ``model`` but have no kernel of that type on the first
    provider, sorted. float16: logged (ONNX Runtime runs them as float32 kernels behind casts it inserts);
    bfloat16: ValueError naming them (ONNX Runtime inserts no casts for bfloat16: the session could not load)."""
    if precision.autocast is None:
        return []
    elem = _ELEM[precision.autocast]
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)}
    opsets = {o.domain or "": o.version for o in model.opset_import}
    ops = {
        (node.domain or "", node.op_type, opsets.get(node.domain or "", 1))
        for node in graph.node
        if node.op_type != "Cast" and any(types.get(out) == elem for out in node.output)
    }
    support = low_precision_support(providers, sorted(ops), elem)
    missing = sorted(op for (_, op), ok in support.items() if not ok)
    if missing and precision.autocast == torch.bfloat16:
        raise ValueError(
            f"mixed_precision.dtype='bfloat16': {_provider_name(providers)} has no bfloat16 kernels for {missing}, "
            "which this model computes in bfloat16 under torch.autocast; use dtype 'float16'"
        )
    if missing:
        _log.warning(
            "mixed precision: %s has no %s kernels for %s; ONNX Runtime runs these nodes in float32 behind casts",
            _provider_name(providers),
            str(precision.autocast).removeprefix("torch."),
            missing,
        )
    return missing


def _provider_name(providers: Sequence) -> str:
    first = providers[0]
    return first if isinstance(first, str) else first[0]
