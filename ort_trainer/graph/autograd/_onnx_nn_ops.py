"""The neural-network ops of `OnnxModule` as torch ops: Gemm, convolution, pooling, normalisation, Dropout,
Softmax, Gelu and the two ONNX losses (see `_onnx_ops` for the rest and for how inputs arrive)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ._onnx_node import OnnxNode, Value, as_tensor, optional, static_float

__all__ = ["NN_OPS"]


def _softmax(function: Callable) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        x = as_tensor(inputs[0])
        if node.opset >= 13:
            return [function(x, dim=node.attrs.get("axis", -1))]
        axis = node.attrs.get("axis", 1) % max(x.dim(), 1)  # before opset 13: over the input flattened to 2-D
        flat = x.reshape(math.prod(x.shape[:axis]), -1)
        return [function(flat, dim=1).reshape(x.shape)]

    return run


def _gelu(node, inputs):
    return [F.gelu(as_tensor(inputs[0]), approximate=node.attrs.get("approximate", "none"))]


def _gemm(node, inputs):
    a, b, c = as_tensor(inputs[0], inputs), as_tensor(inputs[1], inputs), optional(inputs, 2)
    a = a.t() if node.attrs.get("transA", 0) else a
    b = b.t() if node.attrs.get("transB", 0) else b
    alpha, beta = node.attrs.get("alpha", 1.0), node.attrs.get("beta", 1.0)
    if c is None:
        return [a @ b if alpha == 1.0 else alpha * (a @ b)]
    return [torch.addmm(c, a, b, beta=beta, alpha=alpha)]  # as torch.nn.Linear computes it


def _padding(node: OnnxNode, x: torch.Tensor, kernel: Sequence[int], fill: float = 0.0):
    """ONNX ``pads``/``auto_pad`` as torch's symmetric ``padding``; ``x`` padded itself where begin and end differ.
    Returns (x, padding, strides, dilations)."""
    rank = len(kernel)
    strides = node.attrs.get("strides", [1] * rank)
    dilations = node.attrs.get("dilations", [1] * rank)
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        totals = [
            max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
            for n, s, k, d in zip(x.shape[2:], strides, kernel, dilations, strict=True)
        ]
        first = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        pads = first + [t - f for t, f in zip(totals, first, strict=True)]
    elif auto_pad == "VALID":
        pads = [0] * (2 * rank)
    else:
        pads = node.attrs.get("pads", [0] * (2 * rank))
    begin, end = list(pads[:rank]), list(pads[rank:])
    if begin != end:
        torch_pads = [p for b, e in zip(reversed(begin), reversed(end), strict=True) for p in (b, e)]
        return F.pad(x, torch_pads, value=fill), [0] * rank, strides, dilations
    return x, begin, strides, dilations


def _conv(node, inputs):
    x, weight, bias = as_tensor(inputs[0], inputs), as_tensor(inputs[1], inputs), optional(inputs, 2)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(weight.dim() - 2)
    if conv is None:
        raise node.fail(f"a {weight.dim() - 2}-d convolution (1-d to 3-d have a route)")
    x, padding, strides, dilations = _padding(node, x, weight.shape[2:])
    return [conv(x, weight, bias, strides, padding, dilations, node.attrs.get("group", 1))]


def _pool(kind: str) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        if len(node.outputs) > 1 and node.outputs[1]:
            raise node.fail("its Indices output (torch lays pooling indices out differently)")
        x, kernel = as_tensor(inputs[0]), node.attrs["kernel_shape"]
        rank, ceil = len(kernel), bool(node.attrs.get("ceil_mode", 0))
        if kind == "max":
            x, padding, strides, dilations = _padding(node, x, kernel, -math.inf)
            return [
                {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[rank](x, kernel, strides, padding, dilations, ceil)
            ]
        padded, padding, strides, dilations = _padding(node, x, kernel)
        if any(d != 1 for d in dilations):
            raise node.fail("dilations other than 1")
        pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[rank]
        include_pad = bool(node.attrs.get("count_include_pad", 0))
        if include_pad or padded is x:
            return [pool(padded, kernel, strides, padding, ceil, include_pad)]
        # pads that differ at the two ends were added to x itself: average over the elements that are not padding
        ones = _padding(node, torch.ones_like(x[:1, :1]), kernel)[0]
        counts = pool(ones, kernel, strides, padding, ceil, True)
        return [pool(padded, kernel, strides, padding, ceil, True) / counts]

    return run


def _global_pool(function: Callable) -> Callable:
    def run(node: OnnxNode, inputs: Sequence[Value]) -> list[torch.Tensor]:
        x = as_tensor(inputs[0])
        return [function(x, dim=tuple(range(2, x.dim())), keepdim=True)]

    return run


def _batch_norm(node, inputs):
    x, scale, bias, mean, var = (as_tensor(v, inputs) for v in inputs[:5])
    eps = node.attrs.get("epsilon", 1e-5)
    if not (node.training and node.attrs.get("training_mode", 0)):
        return [F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)]
    # torch's update of the running statistics, in place (the engine returns the written state as outputs): ONNX's
    # momentum is torch's 1 - momentum, and the variance the unbiased one, as the onnxblock engine corrects it to
    y = F.batch_norm(x, mean, var, scale, bias, True, 1.0 - node.attrs.get("momentum", 0.9), eps)
    return [y, mean, var]


def _layer_norm(node, inputs):
    x, scale, bias = as_tensor(inputs[0], inputs), as_tensor(inputs[1], inputs), optional(inputs, 2)
    axis, eps = node.attrs.get("axis", -1) % x.dim(), node.attrs.get("epsilon", 1e-5)
    y = F.layer_norm(x, tuple(x.shape[axis:]), scale, bias, eps)
    if len(node.outputs) == 1:
        return [y]
    dims = tuple(range(axis, x.dim()))
    return [y, x.mean(dim=dims, keepdim=True), torch.rsqrt(x.var(dim=dims, unbiased=False, keepdim=True) + eps)]


def _instance_norm(node, inputs):
    x, scale, bias = (as_tensor(v, inputs) for v in inputs[:3])
    return [F.instance_norm(x, weight=scale, bias=bias, eps=node.attrs.get("epsilon", 1e-5))]


def _dropout(node, inputs):
    x, ratio, active = as_tensor(inputs[0]), node.attrs.get("ratio", 0.5), True  # before opset 12: no training_mode
    if node.opset >= 12:
        ratio = static_float(node, inputs, 1, "ratio", 0.5)
        active = bool(static_float(node, inputs, 2, "training_mode", 0.0))
    if not (node.training and active) or ratio == 0.0:
        return [x, torch.ones_like(x, dtype=torch.bool)]
    keep = torch.rand_like(x) >= ratio  # the engine feeds the draw from the step's seed (`lift_random_ops`)
    return [x * keep.to(x.dtype) / (1.0 - ratio), keep]


def _nll(node: OnnxNode, log_prob: torch.Tensor, labels: torch.Tensor, weight) -> torch.Tensor:
    ignore = node.attrs.get("ignore_index", -100)  # torch's default where the node has none
    reduction = node.attrs.get("reduction", "mean")
    weight = weight.detach() if weight is not None else None  # class weights are constants: torch has no gradient
    return F.nll_loss(log_prob, labels.long(), weight, ignore_index=ignore, reduction=reduction)


def _softmax_cross_entropy(node, inputs):
    log_prob = F.log_softmax(as_tensor(inputs[0], inputs), dim=1)
    return [_nll(node, log_prob, as_tensor(inputs[1], inputs), optional(inputs, 2)), log_prob]


def _negative_log_likelihood(node, inputs):
    return [_nll(node, as_tensor(inputs[0], inputs), as_tensor(inputs[1], inputs), optional(inputs, 2))]


NN_OPS = {
    "Softmax": _softmax(torch.softmax), "LogSoftmax": _softmax(torch.log_softmax), "Gelu": _gelu, "Gemm": _gemm,
    "Conv": _conv, "MaxPool": _pool("max"), "AveragePool": _pool("avg"),
    "GlobalAveragePool": _global_pool(torch.mean), "GlobalMaxPool": _global_pool(torch.amax),
    "BatchNormalization": _batch_norm, "LayerNormalization": _layer_norm, "InstanceNormalization": _instance_norm,
    "Dropout": _dropout, "SoftmaxCrossEntropyLoss": _softmax_cross_entropy,
    "NegativeLogLikelihoodLoss": _negative_log_likelihood,
}  # fmt: skip
