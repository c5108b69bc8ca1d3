"""Straightforward per-parameter reference of the legacy update rules (reference §5.3).

Deliberately naive (a Python loop over parameters, float64 math) so it shares no code with the
vectorised `optim.FlatOptimizer` it checks.
"""

from __future__ import annotations

import math

import torch


def clip_divisor(grads, max_norm: float, loss_scale: float = 1.0, clip: bool = True) -> float:
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    return norm / max_norm if clip and norm > loss_scale * max_norm else loss_scale


def adam_step(
    params,
    grads,
    state,
    *,
    lr,
    alpha=0.9,
    beta=0.999,
    lambda_=0.0,
    epsilon=1e-8,
    mode=0,
    bias_correction=True,
    divisor=1.0,
):
    """Legacy Adam for every (param, grad) pair; ``state[i] = [m, v, update_count]``."""
    for i, (w, g) in enumerate(zip(params, grads, strict=True)):
        m, v, t = state.setdefault(
            i, [torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64), 1]
        )
        g = g.double() / divisor
        w64 = w.double()
        m.mul_(alpha).add_((1 - alpha) * g)
        v.mul_(beta).add_((1 - beta) * g * g)
        c1 = 1 - alpha**t if bias_correction else 1.0
        c2 = 1 - beta**t if bias_correction else 1.0
        if mode == 0:
            w64 = w64 - lr * ((m / c1) / ((v / c2).sqrt() + epsilon) + lambda_ * w64)
        else:
            step = lr * math.sqrt(c2) / c1
            w64 = w64 - step * m / (v.sqrt() + epsilon)
            w64 = w64 - lr * lambda_ * w64
        w.copy_(w64.to(w.dtype))
        state[i][2] = t + 1


def lamb_step(
    params,
    grads,
    state,
    *,
    lr,
    alpha=0.9,
    beta=0.999,
    lambda_=0.0,
    epsilon=1e-6,
    bias_correction=False,
    ratio_min=-math.inf,
    ratio_max=math.inf,
    divisor=1.0,
):
    """Legacy Lamb; ``state['step']`` is the one shared Step, ``state[i] = [m, v]``."""
    t = state.setdefault("step", 1)
    for i, (w, g) in enumerate(zip(params, grads, strict=True)):
        m, v = state.setdefault(i, [torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)])
        g = g.double() / divisor
        w64 = w.double()
        m.mul_(alpha).add_((1 - alpha) * g)
        v.mul_(beta).add_((1 - beta) * g * g)
        c1 = 1 - alpha**t if bias_correction else 1.0
        c2 = 1 - beta**t if bias_correction else 1.0
        d = (m / c1) / ((v / c2).sqrt() + epsilon) + lambda_ * w64
        w_norm, d_norm = float((w64**2).sum()), float((d**2).sum())
        ratio = lr * min(max(math.sqrt(w_norm / d_norm), ratio_min), ratio_max) if w_norm and d_norm else lr
        w.copy_((w64 - ratio * d).to(w.dtype))
    state["step"] = t + 1
