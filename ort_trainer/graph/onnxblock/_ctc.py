"""``aten::ctc_loss`` for the exporter: the CTC forward (alpha) recursion unrolled over time.

torch has no ONNX export for ``ctc_loss``. The recursion over the extended label sequence
(blank, l1, blank, l2, ..., blank) is written out step by step (the number of frames T must be
static when tracing), with log-sum-exp from element-wise ops so ONNX Runtime can build its gradient.
Impossible paths hold a large negative number instead of -inf (so no NaN reaches the gradient);
``zero_infinity`` treats a loss above ``_INFINITE`` as infinite. Targets may be padded ``(N, S)`` or
concatenated ``(sum(target_lengths),)`` (as Hugging Face's CTC heads pass them).
"""

from __future__ import annotations

import torch
from torch.onnx import symbolic_helper as sh

__all__ = ["ctc_loss"]

_NEG = -1.0e4  # log(0) stand-in: exp(_NEG - anything real) is 0 in float32
_INFINITE = 5.0e3  # a loss this large came from a path through _NEG: no valid alignment
_INT64 = torch.onnx.TensorProtoDataType.INT64
_FLOAT = torch.onnx.TensorProtoDataType.FLOAT


def _c(g, value, dtype=torch.int64):
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _lse(g, *terms):
    """log(sum(exp(t))) with a shift that carries no gradient (cut to an integer through int64)."""
    top = terms[0]
    for t in terms[1:]:
        top = g.op("Max", top, t)
    shift = g.op("Cast", g.op("Cast", top, to_i=_INT64), to_i=_FLOAT)
    total = None
    for t in terms:
        e = g.op("Exp", g.op("Sub", t, shift))
        total = e if total is None else g.op("Add", total, e)
    return g.op("Add", g.op("Log", total), shift)


def _shift_right(g, x, by: int):
    """``x[:, :-by]`` with ``by`` columns of _NEG in front (N, K) -> (N, K)."""
    kept = g.op("Slice", x, _c(g, [0]), _c(g, [-by]), _c(g, [1]))
    return g.op("Pad", kept, _c(g, [0, by, 0, 0]), _c(g, _NEG, torch.float32))


def _padded_targets(g, targets, target_lengths):
    """(N, S_max) labels from padded (N, S) or concatenated targets."""
    if sh._get_tensor_rank(targets) == 2:
        return targets
    lengths = g.op("Cast", target_lengths, to_i=_INT64)
    starts = g.op("Sub", g.op("CumSum", lengths, _c(g, 0)), lengths)
    longest = g.op("ReduceMax", lengths, keepdims_i=0)
    positions = g.op("Range", _c(g, 0), longest, _c(g, 1))
    index = g.op("Add", g.op("Unsqueeze", starts, _c(g, [1])), g.op("Unsqueeze", positions, _c(g, [0])))
    last = g.op("Sub", g.op("Shape", targets), _c(g, [1]))
    index = g.op("Max", g.op("Min", index, last), _c(g, 0))
    return g.op("Gather", targets, index, axis_i=0)


@sh.parse_args("v", "v", "v", "v", "i", "i", "i")
def ctc_loss(g, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    sizes = sh._get_tensor_sizes(log_probs)
    if not sizes or sizes[0] is None:
        raise torch.onnx.errors.SymbolicValueError(
            "ctc_loss: the number of frames must be static to export it (give model_desc a fixed input length)",
            log_probs,
        )
    frames = sizes[0]
    labels = g.op("Cast", _padded_targets(g, targets, target_lengths), to_i=_INT64)
    rows = g.op("Slice", g.op("Shape", labels), _c(g, [0]), _c(g, [1]))  # [N]
    blanks = g.op("Expand", _c(g, blank), g.op("Shape", labels))
    pairs = g.op("Concat", g.op("Unsqueeze", blanks, _c(g, [2])), g.op("Unsqueeze", labels, _c(g, [2])), axis_i=2)
    ext = g.op("Reshape", pairs, g.op("Concat", rows, _c(g, [-1]), axis_i=0))
    ext = g.op("Concat", ext, g.op("Expand", _c(g, [[blank]]), g.op("Concat", rows, _c(g, [1]), axis_i=0)), axis_i=1)
    ext_shape = g.op("Shape", ext)  # (N, 2S+1)
    gathered = g.op("GatherElements", log_probs, g.op("Expand", g.op("Unsqueeze", ext, _c(g, [0])),
                    g.op("Concat", _c(g, [frames]), ext_shape, axis_i=0)), axis_i=2)  # fmt: skip
    gathered = g.op("Cast", gathered, to_i=_FLOAT)
    ext_before = g.op("Concat", g.op("Expand", _c(g, [[-1, -1]]), g.op("Concat", rows, _c(g, [2]), axis_i=0)),
                      g.op("Slice", ext, _c(g, [0]), _c(g, [-2]), _c(g, [1])), axis_i=1)  # fmt: skip
    may_skip = g.op("And", g.op("Not", g.op("Equal", ext, _c(g, blank))), g.op("Not", g.op("Equal", ext, ext_before)))
    column = g.op("Range", _c(g, 0), g.op("Gather", ext_shape, _c(g, 1), axis_i=0), _c(g, 1))
    start = g.op("Less", g.op("Unsqueeze", column, _c(g, [0])), _c(g, 2))
    neg = _c(g, _NEG, torch.float32)
    frame = lambda t: g.op("Gather", gathered, _c(g, t), axis_i=0)  # noqa: E731
    alpha = g.op("Where", start, frame(0), neg)
    lengths = g.op("Unsqueeze", g.op("Cast", input_lengths, to_i=_INT64), _c(g, [1]))
    for t in range(1, frames):
        one_back, two_back = _shift_right(g, alpha, 1), _shift_right(g, alpha, 2)
        two_back = g.op("Where", may_skip, two_back, neg)
        step = g.op("Add", _lse(g, alpha, one_back, two_back), frame(t))
        alpha = g.op("Where", g.op("Less", _c(g, t), lengths), step, alpha)
    label_count = g.op("Unsqueeze", g.op("Cast", target_lengths, to_i=_INT64), _c(g, [1]))
    end = g.op("Mul", label_count, _c(g, 2))
    last = g.op("GatherElements", alpha, end, axis_i=1)
    before = g.op("GatherElements", alpha, g.op("Max", g.op("Sub", end, _c(g, 1)), _c(g, 0)), axis_i=1)
    before = g.op("Where", g.op("Greater", label_count, _c(g, 0)), before, neg)
    loss = g.op("Neg", g.op("Squeeze", _lse(g, last, before), _c(g, [1])))
    if zero_infinity:
        loss = g.op("Where", g.op("Greater", loss, _c(g, _INFINITE, torch.float32)), _c(g, 0.0, torch.float32), loss)
    if reduction == 0:
        return loss
    if reduction == 2:
        return g.op("ReduceSum", loss, keepdims_i=0)
    per_label = g.op("Cast", g.op("Max", g.op("Squeeze", label_count, _c(g, [1])), _c(g, 1)), to_i=_FLOAT)
    return g.op("ReduceMean", g.op("Div", loss, per_label), keepdims_i=0)
