"""Threads as ranks for the distributed save protocol (``checkpoint.io._set_writer``): a thread-backed
all-gather stands in for the process group, so every branch runs in milliseconds (used by
test_checkpoint_set_writer.py and test_missing_folders.py)."""

from __future__ import annotations

import threading

import numpy as np

from ort_trainer.checkpoint.io import _set_writer as _writer
from ort_trainer.checkpoint.io import resolve
from tests.builders import legacy_trainer_options

__all__ = ["ThreadGroup", "ok", "run_ranks", "save", "tree"]


class ThreadGroup:
    """``world`` threads exchanging objects like ``dist.all_gather_object``."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list = [None] * world

    def rank(self, rank: int):
        group = self

        class Member:
            def __init__(self):
                self.rank, self.world_size = rank, group.world

            def all_gather_object(self, value):
                group.slots[rank] = value
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out

        return Member()


def run_ranks(world: int, fn) -> list:
    """fn(comm) on ``world`` threads; returns each rank's result or exception."""
    group, results = ThreadGroup(world), [None] * world

    def target(rank):
        try:
            results[rank] = fn(group.rank(rank))
        except BaseException as exc:  # collected for the test
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def tree(rank: int, world: int, value: float) -> dict:
    return {
        "model": {"full_precision": {"w": np.full(8, value, dtype=np.float32)}},
        "trainer_options": legacy_trainer_options(
            world_rank=rank, world_size=world, optimizer_name="SGDOptimizer", data_parallel_size=world
        ),
        "train_step_info": {"optimization_step": int(value), "step": int(value)},
    }


def save(paths, value: float, overwrite: bool = True, world: int = 2):
    """Every rank saves ``tree(value)``; ``paths`` is one path for all or one per rank."""

    def fn(comm):
        path = paths[comm.rank] if isinstance(paths, list) else paths
        plan = _writer.plan_set_save(comm, resolve(path), overwrite)
        state = tree(comm.rank, comm.world_size, value)
        state["distributed"] = {"run_id": plan.run_id}
        return _writer.write_set(plan, comm, state, int(value))

    return run_ranks(world, fn)


def ok(results):
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results
