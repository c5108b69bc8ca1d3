"""The per-step check that every rank holds the same state.

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

from typing import Any

import torch
import torch.distributed as dist

from ._store import ParamStore
from ._trainer_state import TrainerState

__all__ = ["PendingRankCheck", "check_ranks_agree", "finish_rank_check", "note_load", "start_rank_check"]


def note_load(store: ParamStore) -> None:
    """A load succeeded on this rank (called once per load, by `_apply`)."""
    store.loads_since_check += 1
    store.diverged = False


def check_ranks_agree(state: TrainerState) -> None:
    """Every rank, at every train_step: raise on all ranks if they loaded different states (module doc)."""
    finish_rank_check(state, start_rank_check(state))


class PendingRankCheck:
    """The all-gather of one step's rank check, in flight while the step's forward/backward runs."""

    def __init__(self, work: Any, gathered: list[torch.Tensor]):
        self.work, self.gathered = work, gathered


def start_rank_check(state: TrainerState) -> PendingRankCheck | None:
    """Launch this step's all-gather of (loads, diverged, step, optimization_step) without waiting for it.

    The step calls this before the forward/backward and `finish_rank_check` after it, before anything is
    committed (counters, optimizer update): the collective overlaps the compute instead of adding a round
    trip to every step. None on a single process.
    """
    store, ctx = state.store, state.store.dist
    if ctx is None:
        return None
    info = state.train_step_info
    mine = torch.tensor(
        [store.loads_since_check, int(store.diverged), info.step, info.optimization_step],
        dtype=torch.int64,
        device=ctx.device,
    )
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    store.loads_since_check = 0
    # Megatron: the data-parallel group of this rank's slice
    return PendingRankCheck(dist.all_gather(gathered, mine, group=ctx.group, async_op=True), gathered)


def finish_rank_check(state: TrainerState, pending: PendingRankCheck | None) -> None:
    """Wait for the step's check; if the ranks hold different states, raise the same error on every rank."""
    if pending is None:
        return
    store = state.store
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
