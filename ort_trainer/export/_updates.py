"""The trainer's optimizer updates (``optim._updates``) and gradient clipping, written as standard ONNX ops.

Each function appends one parameter's update to a `GraphBuilder` and returns the names of the new values. The
formulas, and the order of their float32 operations, are those of `optim._flat_optimizer.FlatOptimizer`, so that
an exported step equals ``ORTTrainer.train_step`` (within float32 rounding):

* Adam in mode 0 with bias correction (``torch.optim.AdamW``) as torch's fused AdamW kernel computes it; other
  Adam modes as `optim._updates.adam_generic`; LAMB as `optim._updates.lamb` (per-parameter trust ratio, a
  non-finite direction dropped element-wise); SGD as ``w - lr * g``.
* The bias corrections ``1 - beta ** step`` and the step sizes derived from them are computed in float64 and cast
  to float32 once, as the trainer computes them in Python floats: in float32, ``beta ** step`` drifts by ~1e-5
  over 20 steps.
* Clipping (Adam and LAMB, ``options.utils.grad_norm_clip``): every gradient divided by ``N / max_norm_clip``
  when the global L2 norm ``N`` exceeds its group's ``max_norm_clip``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ort_trainer.optim.config import DecayMode

from ._builder import GraphBuilder

__all__ = ["Scalars", "adam", "clip_gradients", "lamb", "scalars", "sgd"]


@dataclass(frozen=True)
class Scalars:
    """The step's scalar inputs: lr (float32 []) and, in float64, lr and the 1-based update number."""

    lr: str
    lr64: str
    step64: str


def scalars(b: GraphBuilder, lr: str, step: str) -> Scalars:
    return Scalars(lr=lr, lr64=b.cast(lr, "float64"), step64=b.cast(step, "float64"))


def _correction(b: GraphBuilder, beta: float, s: Scalars) -> str:
    """1 - beta ** step in float64 (`optim._updates.bias_correction`, step >= 1)."""
    return b.op("Sub", b.const(1.0, "float64"), b.op("Pow", b.const(beta, "float64"), s.step64))


def clip_gradients(
    b: GraphBuilder, grads: Mapping[str, str], limits: Mapping[str, float]
) -> tuple[dict[str, str], str]:
    """Gradients divided by ``N / limit`` where the global norm ``N`` exceeds the parameter's group ``limit``
    (else unchanged); and ``N`` (float32 [])."""
    squares = [b.op("ReduceSumSquare", g, keepdims=0) for g in grads.values()]
    total = squares[0] if len(squares) == 1 else b.op("Sum", *squares)
    norm = b.op("Sqrt", total)
    norm64 = b.cast(norm, "float64")
    divisors: dict[float, str] = {}
    for limit in sorted(set(limits.values())):
        limit64 = b.const(float(limit), "float64")
        over = b.op("Greater", norm64, limit64)
        divisor = b.op("Where", over, b.op("Div", norm64, limit64), b.const(1.0, "float64"))
        divisors[limit] = b.cast(divisor, "float32")
    clipped = {name: b.op("Div", g, divisors[limits[name]]) for name, g in grads.items()}
    return clipped, norm


def sgd(b: GraphBuilder, s: Scalars, w: str, g: str) -> str:
    """w - lr * g (``w.add_(g, alpha=-lr)``)."""
    return b.op("Add", w, b.op("Mul", g, b.op("Neg", s.lr)))


def adam(b: GraphBuilder, hp: Mapping[str, Any], s: Scalars, w: str, g: str, m: str, v: str) -> tuple[str, str, str]:
    """(w, m, v) after one Adam update with the group's hyper-parameters ``hp`` (`optim.AdamConfig`)."""
    if hp["weight_decay_mode"] == DecayMode.BEFORE_WEIGHT_UPDATE and hp["do_bias_correction"]:
        return _adamw_fused(b, hp, s, w, g, m, v)
    alpha, beta, lam, eps = hp["alpha"], hp["beta"], hp["lambda"], hp["epsilon"]
    m_new = b.op("Add", b.op("Mul", m, b.const(alpha)), b.op("Mul", g, b.const(1.0 - alpha)))
    v_new = b.op("Add", b.op("Mul", v, b.const(beta)), b.op("Mul", b.op("Mul", g, g), b.const(1.0 - beta)))
    c1 = _correction(b, alpha, s) if hp["do_bias_correction"] else None
    c2 = _correction(b, beta, s) if hp["do_bias_correction"] else None
    if hp["weight_decay_mode"] == DecayMode.BEFORE_WEIGHT_UPDATE:  # no bias correction here (else fused)
        den = b.op("Add", b.op("Sqrt", v_new), b.const(eps))
        tmp = b.op("Div", m_new, den)
        if lam:
            tmp = b.op("Add", tmp, b.op("Mul", w, b.const(lam)))
        return b.op("Add", w, b.op("Mul", tmp, b.op("Neg", s.lr))), m_new, v_new
    den = b.op("Add", b.op("Sqrt", v_new), b.const(eps))
    tmp = b.op("Div", m_new, den)
    scale64 = b.op("Neg", s.lr64)  # -lr * sqrt(c2) / c1, in float64 as in Python
    if c1 is not None:
        scale64 = b.op("Div", b.op("Mul", scale64, b.op("Sqrt", c2)), c1)
    w_new = b.op("Add", w, b.op("Mul", tmp, b.cast(scale64, "float32")))
    if lam:
        decay = b.cast(b.op("Mul", b.op("Neg", s.lr64), b.const(lam, "float64")), "float32")
        w_new = b.op("Add", w_new, b.op("Mul", w_new, decay))
    return w_new, m_new, v_new


def _adamw_fused(
    b: GraphBuilder, hp: Mapping[str, Any], s: Scalars, w: str, g: str, m: str, v: str
) -> tuple[str, str, str]:
    """torch's fused AdamW (CPU kernel): decay first, ``lerp`` for m, step size ``lr / c1`` in float64."""
    alpha, beta, lam, eps = hp["alpha"], hp["beta"], hp["lambda"], hp["epsilon"]
    if lam:
        keep64 = b.op("Sub", b.const(1.0, "float64"), b.op("Mul", s.lr64, b.const(lam, "float64")))
        w = b.op("Mul", w, b.cast(keep64, "float32"))
    weight = 1.0 - alpha  # m.lerp_(g, weight): from the nearer end, as torch's lerp
    if abs(weight) < 0.5:
        m_new = b.op("Add", m, b.op("Mul", b.const(weight), b.op("Sub", g, m)))
    else:
        m_new = b.op("Add", g, b.op("Mul", b.const(weight - 1.0), b.op("Sub", g, m)))
    v_new = b.op("Add", b.op("Mul", v, b.const(beta)), b.op("Mul", b.op("Mul", b.const(1.0 - beta), g), g))
    step_size = b.cast(b.op("Neg", b.op("Div", s.lr64, _correction(b, alpha, s))), "float32")
    root_c2 = b.cast(b.op("Sqrt", _correction(b, beta, s)), "float32")
    den = b.op("Add", b.op("Div", b.op("Sqrt", v_new), root_c2), b.const(eps))
    return b.op("Add", w, b.op("Div", b.op("Mul", step_size, m_new), den)), m_new, v_new


def lamb(b: GraphBuilder, hp: Mapping[str, Any], s: Scalars, w: str, g: str, m: str, v: str) -> tuple[str, str, str]:
    """(w, m, v) after one LAMB update of one parameter (`optim.LambConfig`; its trust ratio is per parameter)."""
    alpha, beta, lam, eps = hp["alpha"], hp["beta"], hp["lambda"], hp["epsilon"]
    m_new = b.op("Add", b.op("Mul", m, b.const(alpha)), b.op("Mul", g, b.const(1.0 - alpha)))
    v_new = b.op("Add", b.op("Mul", v, b.const(beta)), b.op("Mul", b.op("Mul", g, g), b.const(1.0 - beta)))
    v_hat, m_hat = v_new, m_new
    if hp["do_bias_correction"]:
        v_hat = b.op("Div", v_new, b.cast(_correction(b, beta, s), "float32"))
        m_hat = b.op("Div", m_new, b.cast(_correction(b, alpha, s), "float32"))
    d = b.op("Div", m_hat, b.op("Add", b.op("Sqrt", v_hat), b.const(eps)))
    d = b.op("Add", d, b.op("Mul", w, b.const(lam)))
    finite = b.finite(d)  # a non-finite direction: 0 there, and the moments unchanged (legacy kernel)
    d = b.op("Where", finite, d, b.const(0.0))
    m_new, v_new = b.op("Where", finite, m_new, m), b.op("Where", finite, v_new, v)
    w_norm, d_norm = b.norm(w), b.norm(d)
    ratio = b.op("Div", w_norm, d_norm)
    ratio = b.op("Max", b.op("Min", ratio, b.const(hp["ratio_max"])), b.const(hp["ratio_min"]))
    zero = b.const(0.0)
    both = b.op("And", b.op("Not", b.op("Equal", w_norm, zero)), b.op("Not", b.op("Equal", d_norm, zero)))
    ratio = b.op("Mul", b.op("Where", both, ratio, b.const(1.0)), s.lr)
    w_new = b.op("Add", b.op("Mul", d, b.op("Neg", ratio)), w)
    return b.op("Where", b.finite(w_new), w_new, w), m_new, v_new
