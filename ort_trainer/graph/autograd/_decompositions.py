"""The aten decompositions the autograd engine traces with.

``torch._decomp.core_aten_decompositions()`` is required: without it the dynamo exporter's own
``nll_loss_backward`` drops the ``mean`` reduction (every gradient came out batch-size times too large).
On top of it, batch normalisation is decomposed too: the exporter maps a training-mode
``native_batch_norm`` to ONNX ``BatchNormalization`` with the running statistics, so the normalised
values (and the loss) differ from PyTorch's; decomposed, the batch statistics, the unbiased running
variance and the backward are PyTorch's own formulas (tested against PyTorch). ``empty_permuted`` (what
``rand_like`` of a 3-d tensor allocates for Dropout's mask) has no ONNX translation; a dense ``empty`` of
the same shape is the same thing to a graph that has no memory layouts.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

__all__ = ["training_decompositions"]

_aten = torch.ops.aten


@functools.cache
def training_decompositions() -> dict:
    """core aten decompositions + batch norm (forward, functional and backward) as primitive ops."""
    table = dict(core_aten_decompositions())
    table.update(
        get_decompositions(
            [
                _aten.native_batch_norm,
                _aten._native_batch_norm_legit_functional,
                _aten._native_batch_norm_legit,
                _aten._native_batch_norm_legit_no_training,
                _aten.native_batch_norm_backward,
            ]
        )
    )
    table[_aten.empty_permuted.default] = _empty_permuted
    return table


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.empty(size, dtype=dtype, device=device)
