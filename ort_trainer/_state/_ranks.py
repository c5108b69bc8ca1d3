"""State across ranks: the full optimizer state in memory and loads broadcast from rank 0.

The per-step check that every rank loaded the same state is the engine's (`engine._rank_check`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ort_trainer.checkpoint.format import schema as S
from ort_trainer.engine import ParamStore

__all__ = ["broadcast_from_rank0", "full_optimizer_state"]


# ---------------------------------------------------------------------------- full state under ZeRO
def full_optimizer_state(store: ParamStore) -> dict[str, Any]:
    """The whole optimizer state (every parameter's moments) from every rank's ZeRO range; a collective."""
    ctx, zero, optimizer = store.dist, store.zero, store.optimizer
    counts = [c for c in ctx.all_gather_objects(optimizer.update_count()) if c is not None]
    moments = optimizer.local_moments()
    if moments is None:  # SGD: no state
        return {}
    full = []
    for local in moments:
        buffer = torch.zeros(zero.padded, dtype=local.dtype, device=local.device)
        buffer[zero.start : zero.end].copy_(local)
        ctx.all_gather_chunks_(buffer, zero.chunk)
        full.append(store.layout.views(buffer[: store.layout.numel]))
    count = torch.tensor([max(counts)], dtype=torch.int64)
    return {
        name: {S.MOMENT_1_KEY: full[0][name].clone(), S.MOMENT_2_KEY: full[1][name].clone(), S.UPDATE_COUNT_KEY: count}
        for name in store.layout.names
    }


# ---------------------------------------------------------------------------- broadcast_from_rank0
def broadcast_from_rank0(store: ParamStore, state: Any, check: Any) -> Any:
    """Rank 0's ``state`` on every rank (a collective). ``check(state)`` runs on rank 0 first; its error is
    raised on every rank (nothing is sent then)."""
    ctx = store.dist
    if ctx is None:
        return state
    layout, error = None, None
    if ctx.rank == 0:
        try:
            check(state)
            layout = _describe(state)
        except (TypeError, ValueError, KeyError) as exc:
            error = (type(exc).__name__, exc.args[0] if exc.args else str(exc))
    box = [(layout, error)]
    dist.broadcast_object_list(box, src=0)
    layout, error = box[0]
    if error is not None:
        kind = {"TypeError": TypeError, "KeyError": KeyError}.get(error[0], ValueError)
        raise kind(f"broadcast_from_rank0: rank 0's state is invalid: {error[1]}")
    return _receive(ctx, layout, state if ctx.rank == 0 else None)


def _describe(tree: Any) -> Any:
    """The tree with tensors replaced by ("tensor", shape, dtype name); other leaves kept (small values)."""
    if isinstance(tree, Mapping):
        return {"dict": {k: _describe(v) for k, v in tree.items()}}
    if isinstance(tree, torch.Tensor):
        return {"tensor": (tuple(tree.shape), str(tree.dtype).removeprefix("torch."))}
    return {"value": tree}


def _receive(ctx, layout: Any, source: Any) -> Any:
    kind, content = next(iter(layout.items()))
    if kind == "dict":
        return {k: _receive(ctx, v, source[k] if source is not None else None) for k, v in content.items()}
    if kind == "value":
        return content
    shape, dtype = content
    if source is not None:
        tensor = source.detach().to(ctx.device).contiguous()
    else:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=ctx.device)
    if tensor.numel():
        dist.broadcast(tensor.view(-1) if tensor.dim() else tensor, src=0)
    return tensor
