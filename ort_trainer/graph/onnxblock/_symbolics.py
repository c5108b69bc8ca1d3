"""Exporter symbolics (TorchScript exporter, opset >= 13) for aten ops that torch 2.x cannot export.

* ``aten::diff`` (transformers 5 looks for packed sequences with ``torch.diff(position_ids)`` when a
  causal LM gets no attention mask and no cache: Llama-family models with ``use_cache=False``,
  Whisper): ``Slice(x, 1:) - Slice(x, :-1)`` along ``dim``, ``n`` times, after ``prepend``/``append``.
  Boolean tensors take ``Xor``, as torch does.
* ``aten::histc`` (Mixtral-style MoE counts tokens per expert with ``torch.histc``): one ``Equal`` of
  each element's bin against ``Range(bins)``, summed over elements: torch's bins (``(x - min) * bins /
  (max - min)``, the top edge in the last bin, elements outside ``[min, max]`` not counted; ``min ==
  max`` takes the data's range, widened by 1 each way if that is empty).

* ``aten::cumsum`` of a boolean tensor (the same packed-sequence check: ``(diff != 1).cumsum(-1)``):
  torch's symbolic emits ``CumSum`` on ``bool``, which ONNX refuses; the input is cast to int64 first
  (torch's result type), then torch's own symbolic runs.

* ``aten::group_norm``: torch exports it through ``InstanceNormalization``, which ONNX Runtime 1.19
  cannot differentiate (Wav2Vec2's feature encoder); written out with ``ReduceMean`` over each group
  instead (biased variance, as torch), then the per-channel affine.

* ``aten::ctc_loss``: the CTC forward recursion unrolled over the (static) frames, see `_ctc`.

* ``aten::cross_entropy_loss`` with ``label_smoothing`` (torch's symbolic refuses it): torch's formula
  (`_label_smoothing`), during our export only.

* ``aten::embedding`` and ``aten::detach``: during our export only, a ``padding_idx`` row that the lookup
  gives no gradient (`_embedding`) and a detached tensor that carries none (`_no_gradient`), as in torch;
  torch's own symbolics everywhere else.

Registered once, before the first export (:func:`register_symbolics`), in torch's process-wide registry
(the user's own ``torch.onnx.export`` calls see them from then on; they compute torch's values). For
diff, histc and ctc_loss a symbolic the user registered first is kept; group_norm, cumsum, embedding,
detach and cross_entropy_loss replace torch's own (embedding and cross_entropy_loss call it where they change
nothing).
"""

from __future__ import annotations

import torch
from torch.onnx import symbolic_helper as sh

from ._ctc import ctc_loss
from ._embedding import embedding_symbolic
from ._label_smoothing import cross_entropy_symbolic
from ._no_gradient import detach_symbolic

__all__ = ["register_symbolics"]

_OPSET = 13  # Slice, ReduceSum, Unsqueeze with axes as inputs
_INT64_MAX = 2**63 - 1
_registered = False


def register_symbolics() -> None:
    """Make the TorchScript exporter know ``aten::diff`` and ``aten::histc`` (idempotent)."""
    global _registered
    if _registered:
        return
    for name, fn in (("aten::diff", _diff), ("aten::histc", _histc), ("aten::ctc_loss", ctc_loss)):
        if _symbolic(name) is None:
            torch.onnx.register_custom_op_symbolic(name, fn, _OPSET)
    torch.onnx.register_custom_op_symbolic("aten::group_norm", _group_norm, _OPSET)
    torch_cumsum = _symbolic("aten::cumsum")
    if torch_cumsum is not None:
        torch.onnx.register_custom_op_symbolic("aten::cumsum", _bool_safe_cumsum(torch_cumsum), _OPSET)
    torch.onnx.register_custom_op_symbolic("aten::embedding", embedding_symbolic(_symbolic("aten::embedding")), _OPSET)
    torch.onnx.register_custom_op_symbolic("aten::detach", detach_symbolic(), _OPSET)
    torch_cross_entropy = _symbolic("aten::cross_entropy_loss")
    if torch_cross_entropy is not None:
        torch.onnx.register_custom_op_symbolic(
            "aten::cross_entropy_loss", cross_entropy_symbolic(torch_cross_entropy), _OPSET
        )
    _registered = True


def _symbolic(name: str):
    """The exporter's symbolic for ``name`` at our opset (torch's own, or one the user registered), or None."""
    try:  # torch registers its opset-11+ symbolics when their module is imported (at the first export)
        from torch.onnx._internal.torchscript_exporter import (  # noqa: F401
            registration,
            symbolic_opset11,
            symbolic_opset12,
        )
    except ImportError:  # another torch layout: ours are registered (and cumsum left alone)
        return None
    group = registration.registry.get_function_group(name)
    return None if group is None else group.get(_OPSET)


def _bool_safe_cumsum(torch_cumsum):
    def cumsum(g, x, dim, dtype):
        if sh._is_none(dtype) and _is_bool(x):
            x = g.op("Cast", x, to_i=torch.onnx.TensorProtoDataType.INT64)
        return torch_cumsum(g, x, dim, dtype)

    return cumsum


def _onnx_type(x) -> int:
    dtype = x.type().dtype() if x.type().kind() == "TensorType" and x.type().scalarType() else torch.float32
    return {torch.float16: 10, torch.bfloat16: 16, torch.float64: 11}.get(dtype, 1)


def _is_bool(x) -> bool:
    return x.type().kind() == "TensorType" and x.type().scalarType() == "Bool"


def _ints(g, *values: int):
    return g.op("Constant", value_t=torch.tensor(list(values), dtype=torch.int64))


def _scalar_like(g, value: float, like):
    """A scalar constant in ``like``'s dtype (known when tracing; no ``CastLike``: ORT has no gradient for it)."""
    dtype = like.type().dtype() if like.type().kind() == "TensorType" and like.type().scalarType() else None
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype or torch.float32))


@sh.parse_args("v", "i", "i", "v", "v")
def _diff(g, x, n, dim, prepend, append):
    if not sh._is_none(prepend):
        x = g.op("Concat", prepend, x, axis_i=dim)
    if not sh._is_none(append):
        x = g.op("Concat", x, append, axis_i=dim)
    is_bool = _is_bool(x)
    axes = _ints(g, dim)
    for _ in range(n):
        later = g.op("Slice", x, _ints(g, 1), _ints(g, _INT64_MAX), axes)
        earlier = g.op("Slice", x, _ints(g, 0), _ints(g, -1), axes)
        x = g.op("Xor" if is_bool else "Sub", later, earlier)
    return x


@sh.parse_args("v", "i", "f", "f")
def _histc(g, x, bins, low, high):
    flat = g.op("Reshape", x, _ints(g, -1))
    if low == high:  # torch: the data's range; an empty one widened by 1 each way
        lo, hi = g.op("ReduceMin", flat, keepdims_i=0), g.op("ReduceMax", flat, keepdims_i=0)
        empty = g.op("Equal", lo, hi)
        one = _scalar_like(g, 1.0, flat)
        lo = g.op("Where", empty, g.op("Sub", lo, one), lo)
        hi = g.op("Where", empty, g.op("Add", hi, one), hi)
    else:
        lo, hi = _scalar_like(g, low, flat), _scalar_like(g, high, flat)
    position = g.op("Div", g.op("Mul", g.op("Sub", flat, lo), _scalar_like(g, float(bins), flat)), g.op("Sub", hi, lo))
    index = g.op("Cast", g.op("Floor", position), to_i=torch.onnx.TensorProtoDataType.INT64)
    index = g.op("Min", index, _ints(g, bins - 1))  # the top edge belongs to the last bin
    inside = g.op("And", g.op("GreaterOrEqual", flat, lo), g.op("LessOrEqual", flat, hi))
    every_bin = g.op(
        "Range",
        g.op("Constant", value_t=torch.tensor(0)),
        g.op("Constant", value_t=torch.tensor(bins)),
        g.op("Constant", value_t=torch.tensor(1)),
    )
    hits = g.op("Equal", g.op("Unsqueeze", index, _ints(g, 1)), every_bin)
    hits = g.op("And", hits, g.op("Unsqueeze", inside, _ints(g, 1)))
    counts = g.op("ReduceSum", g.op("Cast", hits, to_i=torch.onnx.TensorProtoDataType.FLOAT), _ints(g, 0), keepdims_i=0)
    return g.op("Cast", counts, to_i=_onnx_type(flat))


def _reduce_mean(g, x, axis: int):
    if g.opset >= 18:  # axes became an input
        return g.op("ReduceMean", x, _ints(g, axis), keepdims_i=1)
    return g.op("ReduceMean", x, axes_i=[axis], keepdims_i=1)


@sh.parse_args("v", "i", "v", "v", "f", "i")
def _group_norm(g, x, groups, weight, bias, eps, cudnn_enabled):
    rank = sh._get_tensor_rank(x)
    if rank is None:
        raise torch.onnx.errors.SymbolicValueError("group_norm: the input's rank must be known to export it", x)
    grouped = g.op("Reshape", x, _ints(g, 0, groups, -1))  # (N, G, C/G * spatial)
    centered = g.op("Sub", grouped, _reduce_mean(g, grouped, 2))
    variance = _reduce_mean(g, g.op("Mul", centered, centered), 2)
    normed = g.op("Div", centered, g.op("Sqrt", g.op("Add", variance, _scalar_like(g, eps, x))))
    out = g.op("Reshape", normed, g.op("Shape", x))
    channel_axes = _ints(g, *range(1, rank - 1))  # weight (C,) -> (C, 1, ..., 1)
    if not sh._is_none(weight):
        out = g.op("Mul", out, g.op("Unsqueeze", weight, channel_axes) if rank > 2 else weight)
    if not sh._is_none(bias):
        out = g.op("Add", out, g.op("Unsqueeze", bias, channel_axes) if rank > 2 else bias)
    return out
