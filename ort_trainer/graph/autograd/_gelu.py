"""Exact (erf) GELU and its backward as decompositions whose forward and backward share one ``erf``.

Left to the exporter, ``gelu`` is onnxscript's five nodes and ``gelu_backward`` PyTorch's core decomposition,
eleven more that compute ``erf`` again (written differently, ``x * 0.7071`` where the forward divides by
``sqrt(2)``, so nothing merges them), and ONNX Runtime's GeluFusion matches neither. Here both ops are written
with the same ``cdf`` subexpression, ``(erf(x * sqrt(1/2)) + 1) * 0.5``: the exporter's common-subexpression
pass merges the two copies in a training graph, so the backward reads the forward's ``x * sqrt(1/2)`` and
``cdf`` and adds six nodes and no ``erf``: eleven nodes for the pair instead of sixteen, ~26 % less CPU time at
HF BERT-small's ``[16, 96, 1024]`` in ONNX Runtime (one thread; 6.7 against 9.0 ms, PyTorch's two kernels 3.7).
What it costs: ``cdf`` lives from the forward to the backward, one more tensor of the GELU's size per GELU (x
itself is then read by the forward only); the peak RSS of ``benchmarks/varlen.py --model bert-small`` did not
move (770 MiB). Where the forward and the backward are graphs of their own (ORTModule, the ``torch.compile``
backend), the backward computes its own ``cdf``: ten nodes where PyTorch's decomposition wrote eleven.

The formulas are PyTorch's CPU kernels' (``aten/src/ATen/native/cpu/Activation.cpp``):
``gelu = x * 0.5 * (1 + erf(x / sqrt(2)))`` and ``gelu' = cdf + x * exp(-x^2 / 2) / sqrt(2 pi)``, the latter
as ``s / exp(s * s) / sqrt(pi)`` with ``s = x / sqrt(2)``; half-precision inputs are computed in float32 and
rounded once, as PyTorch's kernels compute them. The tanh approximation keeps the exporter's ``gelu`` and
PyTorch's decomposition of its backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["gelu", "gelu_backward_with"]

_SQRT_HALF = 0.70710678118654752440  # 1 / sqrt(2): M_SQRT1_2
_RSQRT_PI = 0.56418958354775628695  # 1 / sqrt(pi): M_2_SQRTPI / 2
_HALF = (torch.float16, torch.bfloat16)


def _scaled_and_cdf(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x / sqrt(2)``, ``Phi(x)``), written the same way for the forward and the backward, so that the export
    computes them once."""
    scaled = x * _SQRT_HALF
    return scaled, (torch.erf(scaled) + 1) * 0.5


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``aten.gelu`` as ``x * Phi(x)``; NotImplemented (the op is kept whole) for ``approximate="tanh"``."""
    if approximate != "none":
        return NotImplemented
    dtype = x.dtype
    if dtype in _HALF:
        x = x.float()
    return (x * _scaled_and_cdf(x)[1]).to(dtype)


def gelu_backward_with(default: Callable) -> Callable:
    """``aten.gelu_backward`` for the exact GELU, ``default`` (PyTorch's decomposition) for the tanh one."""

    def gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        if approximate != "none":
            return default(grad, x, approximate=approximate)
        dtype = grad.dtype
        if dtype in _HALF:
            grad, x = grad.float(), x.float()
        scaled, cdf = _scaled_and_cdf(x)
        x_pdf = scaled / torch.exp(scaled * scaled) * _RSQRT_PI  # x * exp(-x^2 / 2) / sqrt(2 pi)
        return (grad * (cdf + x_pdf)).to(dtype)

    return gelu_backward
