"""State across ranks: the full optimizer state in memory, loads broadcast from rank 0, and the check
that every rank loaded the same state.

Why a load on some ranks only is caught at the next step (and not inside the load): a collective
inside ``load_state_dict`` would hang when other ranks never call it, and a timeout would turn that
hang into a guess. Instead every rank counts its successful loads (`note_load`), and every
``train_step`` launches one small all-gather of (loads since the last check, diverged flag, step,
optimization_step) from every rank; all ranks run it at the same step because they all call
``train_step`` equally often. It is in flight while the step's forward/backward runs and is waited for
before anything is committed. If the counts or counters differ, every rank raises the same
RuntimeError before the update and before its counters move (no rank waits in a collective the others
skip), marks itself diverged and refuses further steps until it loads a state again; once every rank
has loaded, the next step runs. Overlapped with the compute, the collective of 4 integers costs almost
nothing per step (`benchmarks/rank_check.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ort_trainer.checkpoint.format import _schema as K
from ort_trainer.engine._store import ParamStore

from .._owner import StateOwner

__all__ = [
    "PendingRankCheck",
    "broadcast_from_rank0",
    "check_ranks_agree",
    "finish_rank_check",
    "full_optimizer_state",
    "note_load",
    "start_rank_check",
]


def note_load(store: ParamStore) -> None:
    """A load succeeded on this rank (called once per load, by `_apply`)."""
    store.loads_since_check += 1
    store.diverged = False


def check_ranks_agree(trainer: StateOwner) -> None:
    """Every rank, at every train_step: raise on all ranks if they loaded different states (module doc)."""
    finish_rank_check(trainer, start_rank_check(trainer))


class PendingRankCheck:
    """The all-gather of one step's rank check, in flight while the step's forward/backward runs."""

    def __init__(self, work: Any, gathered: list[torch.Tensor]):
        self.work, self.gathered = work, gathered


def start_rank_check(trainer: StateOwner) -> PendingRankCheck | None:
    """Launch this step's all-gather of (loads, diverged, step, optimization_step) without waiting for it.

    The trainer calls this before the forward/backward and `finish_rank_check` after it, before anything is
    committed (counters, optimizer update): the collective overlaps the compute instead of adding a round
    trip to every step. None on a single process.
    """
    store, ctx = trainer._store, trainer._store.dist
    if ctx is None:
        return None
    info = trainer._train_step_info
    mine = torch.tensor(
        [store.loads_since_check, int(store.diverged), info.step, info.optimization_step],
        dtype=torch.int64,
        device=ctx.device,
    )
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    store.loads_since_check = 0
    group = getattr(ctx, "group", None)  # Megatron: the data-parallel group of this rank's slice
    return PendingRankCheck(dist.all_gather(gathered, mine, group=group, async_op=True), gathered)


def finish_rank_check(trainer: StateOwner, pending: PendingRankCheck | None) -> None:
    """Wait for the step's check; if the ranks hold different states, raise the same error on every rank."""
    if pending is None:
        return
    store = trainer._store
    pending.work.wait()
    rows = [t.tolist() for t in pending.gathered]
    problem = _disagreement(rows, store.diverged_reason)
    if problem is None:
        store.diverged_reason = ""
        return
    store.diverged = True
    store.diverged_reason = store.diverged_reason or problem
    raise RuntimeError(
        f"{problem}. Every rank must load the same state: call load_state_dict/load_checkpoint on every rank "
        "(or pass StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) on every rank). The ranks "
        "hold different states, so this step was not committed (no update, counters unchanged); load one state "
        "on every rank to continue."
    )


def _disagreement(rows: list[list[int]], earlier: str) -> str | None:
    loads = [row[0] for row in rows]
    diverged = [r for r, row in enumerate(rows) if row[1]]
    if len(set(loads)) > 1:
        most = max(loads)
        high = [r for r, n in enumerate(loads) if n == most]
        low = [r for r, n in enumerate(loads) if n != most]
        return f"ranks {high} loaded a state that ranks {low} did not load (loads since the last step: {loads})"
    if diverged:
        return f"the ranks still hold different states ({earlier}): ranks {diverged} have not loaded a state since"
    steps = [tuple(row[2:]) for row in rows]
    if len(set(steps)) > 1:
        shown = ", ".join(f"rank {r}: step {s}, optimization_step {o}" for r, (s, o) in enumerate(steps))
        return f"the ranks disagree on their step counters ({shown})"
    return None


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
        name: {K.MOMENT_1_KEY: full[0][name].clone(), K.MOMENT_2_KEY: full[1][name].clone(), K.UPDATE_COUNT_KEY: count}
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
