"""The two Megatron communication points, as marker ops in the exported graph.

Megatron-LM's ``mappings.py`` names them f (``copy_to_tensor_model_parallel_region``: identity
forward, all-reduce of the gradient backward) and g (``reduce_from_tensor_model_parallel_region``:
all-reduce forward, identity backward). Here they are identity functions in torch that the
TorchScript exporter writes as custom-domain nodes (``COPY_OP`` / ``REDUCE_OP``). No ONNX Runtime
session ever sees them: `segments` cuts the graph at every marker and `runner` runs the collective
between the pieces.
"""

from __future__ import annotations

import torch

__all__ = ["COPY_OP", "DOMAIN", "REDUCE_OP", "copy_to_parallel", "reduce_from_parallel"]

DOMAIN = "ort_trainer.parallel"
COPY_OP = "CopyToParallel"  # f: identity forward, all-reduce of the gradient
REDUCE_OP = "ReduceFromParallel"  # g: all-reduce forward, identity backward


class _Marker(torch.autograd.Function):
    op = ""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Copy(_Marker):
    @staticmethod
    def symbolic(g, x):
        out = g.op(f"{DOMAIN}::{COPY_OP}", x)
        out.setType(x.type())
        return out


class _Reduce(_Marker):
    @staticmethod
    def symbolic(g, x):
        out = g.op(f"{DOMAIN}::{REDUCE_OP}", x)
        out.setType(x.type())
        return out


def copy_to_parallel(x: torch.Tensor) -> torch.Tensor:
    """f: the replicated input of a column-parallel layer (its gradient is summed over the horizontal group)."""
    return _Copy.apply(x)


def reduce_from_parallel(x: torch.Tensor) -> torch.Tensor:
    """g: the partial output of a row-parallel layer, summed over the horizontal group."""
    return _Reduce.apply(x)
