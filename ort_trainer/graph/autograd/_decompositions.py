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

__all__ = ["symbolic_decompositions", "training_decompositions"]

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
    table[_aten.convolution_backward.default] = _convolution_backward
    table[_aten._weight_norm_interface_backward.default] = _weight_norm_backward
    table[_aten.copy.default] = _copy
    return table


@functools.cache
def symbolic_decompositions() -> dict:
    """`training_decompositions` for a trace with symbolic sizes, which reaches Dropout as ``native_dropout`` (a
    fake-mode trace reaches it as ``bernoulli``): as ``rand_like`` its draw is lifted into an input like every
    other (`_random`), not left to ONNX's own seeded Dropout. (ORTModule lifts ``native_dropout`` itself, as a
    keep-mask drawn as eager draws it, so its table keeps the op.)"""
    table = dict(training_decompositions())
    table.update(get_decompositions([_aten.native_dropout]))
    return table


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.empty(size, dtype=dtype, device=device)


def _convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """``convolution_backward`` (no ONNX translation) as convolutions the exporter has: the input gradient a
    transposed convolution with the same weight, the weight gradient a grouped convolution of the input with
    the output gradient (strides and dilations swapped; the formula torch.nn.grad used), the bias gradient a sum.
    Transposed convolutions are left alone (the exporter then names the op)."""
    if transposed:
        return NotImplemented
    spatial = input.dim() - 2
    stride, padding, dilation = (list(_expand(v, spatial)) for v in (stride, padding, dilation))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        kernel = weight.shape[2:]
        out_padding = [
            input.shape[2 + i]
            - ((grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1)
            for i in range(spatial)
        ]
        grad_input = torch.ops.aten.convolution.default(
            grad_output, weight, None, stride, padding, dilation, True, out_padding, groups
        )
    if output_mask[1]:
        grad_weight = _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups):
    """The weight gradient as one convolution with the batch as its channels: the input's channels of a group are
    the batch (``(in per group, groups * batch, *spatial)``), the output gradient's maps are the kernels
    (``(out channels, batch, *spatial_out)``), strides and dilations swapped, ``groups`` groups. The batch is a
    size, never an attribute, so a graph with a symbolic batch size exports too (``groups * batch`` groups, the
    formula torch.nn.grad used, put the batch into Conv's ``group`` attribute)."""
    batch = input.shape[0]
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    out_per_group = out_channels // groups
    spatial = list(range(3, input.dim() + 1))
    x = input.reshape(batch, groups, in_per_group, *input.shape[2:]).permute(2, 1, 0, *spatial)
    x = x.reshape(in_per_group, groups * batch, *input.shape[2:])
    go = grad_output.reshape(batch, groups, out_per_group, *grad_output.shape[2:]).permute(1, 2, 0, *spatial)
    go = go.reshape(out_channels, batch, *grad_output.shape[2:])
    result = torch.ops.aten.convolution.default(
        x, go, None, dilation, padding, stride, False, [0] * (input.dim() - 2), groups
    )
    result = result.transpose(0, 1)
    for axis, size in enumerate(weight.shape[2:]):
        result = result.narrow(2 + axis, 0, size)
    return result.contiguous()


def _expand(value, count: int) -> list[int]:
    value = list(value) if isinstance(value, list | tuple) else [value]
    return value * count if len(value) == 1 else value


def _weight_norm_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """``_weight_norm_interface_backward`` (no ONNX translation) for ``w = g * v / ||v||``, the norm over every
    axis but ``dim``: ``grad_g = sum(grad_w * v) / ||v||``, ``grad_v = g / ||v|| * (grad_w - v * grad_g / ||v||)``."""
    axes = [axis for axis in range(saved_v.dim()) if axis != dim % saved_v.dim()]
    norms = saved_norms.reshape(saved_g.shape)
    grad_g = (grad_w * saved_v).sum(axes, keepdim=True) / norms
    grad_v = (saved_g / norms) * (grad_w - saved_v * (grad_g / norms))
    return grad_v, grad_g.reshape(saved_g.shape)


def _copy(self, src, non_blocking=False):
    """Functional ``copy(dst, src)``: ``src`` broadcast to ``dst``'s shape in ``dst``'s dtype. The exporter's own
    ``copy`` keeps the source's shape, and its optimizer then folds a constant with the wrong rank (BART's
    ``shifted[:, 0] = decoder_start_token_id`` became a 0-d column that ONNX Runtime refuses to load)."""
    if tuple(src.shape) == tuple(self.shape) and src.dtype == self.dtype and src.device == self.device:
        return src.clone()
    return src.to(dtype=self.dtype, device=self.device).expand(self.shape).clone()
