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
import sys

import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ._gelu import gelu, gelu_backward_with

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
                # a symbolic trace reaches Dropout as native_dropout (a fake-mode trace as bernoulli): as rand_like,
                # its draw is lifted into an input like every other (`_random`), not left to ONNX's own Dropout
                _aten.native_dropout,
            ]
        )
    )
    table[_aten.empty_permuted.default] = _empty_permuted
    table[_aten.convolution_backward.default] = _convolution_backward
    table[_aten._weight_norm_interface_backward.default] = _weight_norm_backward
    table[_aten.copy.default] = _copy
    table[_aten.gelu.default] = gelu  # forward and backward share one erf (`_gelu`)
    table[_aten.gelu_backward.default] = gelu_backward_with(table[_aten.gelu_backward.default])
    table[_aten.slice_backward.default] = functools.partial(_slice_backward, table[_aten.slice_backward.default])
    return table


def _slice_backward(default, grad_output, input_sizes, dim, start, end, step):
    """The gradient of a slice (``logits[:, :-1]`` before a shifted LM loss) as the slice's gradient padded with
    zeros: one tensor of the input's size. PyTorch's decomposition writes zeros of that size and scatters the
    gradient into them (``slice_scatter``), which the exporter spells as the zeros, two transposes and a
    ``ScatterND`` (and once more for each sliced dim): at GPT-2 124M, batch 4 x 128, five [4, 128, 50257] tensors
    (98 MiB each) at the top of the backward, where this writes one. Only where the bounds are known to lie in
    the dim without a guard on a symbolic size; any other slice keeps ``default``."""
    ndim = len(input_sizes)
    dim = dim % ndim
    size = input_sizes[dim]
    first, stop = _bound(start, size), _bound(end, size)
    if step != 1 or first is None or stop is None:
        return default(grad_output, input_sizes, dim, start, end, step)
    after = size - stop
    if statically_known_true(first == 0) and statically_known_true(after == 0):
        return grad_output.clone()  # the whole dim: a slice that cuts nothing (``x[:, :]``)
    pads = [0, 0] * (ndim - 1 - dim) + [first, after]
    return torch.ops.aten.constant_pad_nd.default(grad_output, pads, 0.0)


def _bound(value, size):
    """A slice bound as an index in ``[0, size]``, or None where that needs a guard on a symbolic size: a negative
    int counts from the end, an int at least ``size`` (``sys.maxsize`` for an open end) is ``size``."""
    if isinstance(value, int) and value >= sys.maxsize // 2:
        return size
    if isinstance(value, int) and value < 0:
        value = size + value
    if statically_known_true(value >= 0) and statically_known_true(value <= size):
        return value
    return None


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
        if all(isinstance(p, int) for p in out_padding):
            grad_input = torch.ops.aten.convolution.default(
                grad_output, weight, None, stride, padding, dilation, True, out_padding, groups
            )
        else:  # symbolic sizes: ONNX's output_padding is an attribute, a constant; the rows it adds are the
            # input's last ones that no window reached (fewer than the stride), so their gradient is zero: padded
            # on by stride - 1 and the input's rows gathered (a gather, not a slice: a slice is a view, and the
            # trace would guard on whether it is contiguous). A pad of the symbolic amount itself would make the
            # trace assume it is (or is not) zero: images of odd and even width would need graphs of their own
            grad_input = torch.ops.aten.convolution.default(
                grad_output, weight, None, stride, padding, dilation, True, [0] * spatial, groups
            )
            pads = [size for s in reversed(stride) for size in (0, s - 1)]
            grad_input = torch.ops.aten.constant_pad_nd.default(grad_input, pads, 0.0)
            for i in range(spatial):
                rows = torch.arange(input.shape[2 + i], device=grad_input.device)
                grad_input = torch.ops.aten.index_select.default(grad_input, 2 + i, rows)
    if output_mask[1]:
        grad_weight = _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups):
    """Each (sample, input channel) map convolved with the output-gradient maps of its group, as one grouped
    convolution (strides and dilations swapped), summed over the batch and laid out as the weight."""
    batch, in_channels = input.shape[0], input.shape[1]
    if not isinstance(batch * in_channels, int):  # a symbolic batch: ONNX's Conv takes its groups as a constant
        return _weight_gradient_over_batch(grad_output, input, weight, stride, padding, dilation, groups)
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    out_per_group = out_channels // groups
    spatial_out, spatial_in = list(grad_output.shape[2:]), list(input.shape[2:])
    go = grad_output.reshape(batch, groups, 1, out_per_group, *spatial_out)
    go = go.expand(batch, groups, in_per_group, out_per_group, *spatial_out)
    go = go.reshape(batch * in_channels * out_per_group, 1, *spatial_out)
    x = input.reshape(1, batch * in_channels, *spatial_in)
    result = torch.ops.aten.convolution.default(
        x, go, None, dilation, padding, stride, False, [0] * len(spatial_out), batch * in_channels
    )
    kernel = list(result.shape[2:])
    result = result.reshape(batch, groups, in_per_group, out_per_group, *kernel).sum(0)
    result = result.transpose(1, 2).reshape(out_channels, in_per_group, *kernel)
    return _cut_to_kernel(result, weight.shape[2:])


def _weight_gradient_over_batch(grad_output, input, weight, stride, padding, dilation, groups):
    """The weight gradient as one convolution whose channels are the batch: the input laid out as (input channels
    of a group, groups x batch, ...) convolved with the output gradient as (groups x output channels of a group,
    batch, ...) filters, ``groups`` groups (a constant, whatever the batch size); strides and dilations swapped."""
    batch, spatial_in, spatial_out = input.shape[0], list(input.shape[2:]), list(grad_output.shape[2:])
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    out_per_group = out_channels // groups
    axes = list(range(3, 3 + len(spatial_in)))
    x = input.reshape(batch, groups, in_per_group, *spatial_in).permute(2, 1, 0, *axes)
    x = x.reshape(in_per_group, groups * batch, *spatial_in)
    go = grad_output.reshape(batch, groups, out_per_group, *spatial_out).permute(1, 2, 0, *axes)
    go = go.reshape(out_channels, batch, *spatial_out)
    result = torch.ops.aten.convolution.default(
        x, go, None, dilation, padding, stride, False, [0] * len(spatial_out), groups
    )  # (in_per_group, out_channels, kernel...)
    return _cut_to_kernel(result.transpose(0, 1), weight.shape[2:])


def _cut_to_kernel(result, kernel):
    """The first ``kernel`` rows of ``result``'s spatial axes. Where the result's size is symbolic (the input's
    size less whole strides: 3 or 4 for a stride-2 3x3 conv on odd or even images) a gather, not a slice: a slice
    is a view, and the trace would guard on whether it is contiguous, so that images of odd and even sizes
    needed graphs of their own."""
    for axis, size in enumerate(kernel):
        if isinstance(result.shape[2 + axis], int):
            result = result.narrow(2 + axis, 0, size)
        else:
            rows = torch.arange(size, device=result.device)
            result = torch.ops.aten.index_select.default(result, 2 + axis, rows)
    return result


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
