"""Checkpoints of a custom loop's objects: ``save_objects`` / ``load_objects`` and the manager's adapter.

``state`` is a dict of objects following torch's Stateful protocol (``state_dict()`` /
``load_state_dict()``): modules (plain, DDP, compiled), torch optimizers, ``ZeroRedundancyOptimizer``, LR
schedulers, ``GradScaler``, samplers, :class:`RNGState`, your own objects. ``CheckpointManager.save`` and
``restore`` take such a dict in place of a trainer through :class:`ObjectsCheckpointable`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ..io import SaveHandle, SaveScheduler, local_inputs, resolve
from ._group import current_group
from ._kinds import check_state
from ._restore import read_objects, restore_objects
from ._save import save_objects_to

__all__ = ["ObjectsCheckpointable", "load_objects", "save_objects"]

_IO = SaveScheduler()  # the module-level writer of save_objects (one save at a time, as a trainer's)


def save_objects(
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    step: int = 0,
    user_dict: Mapping | None = None,
    overwrite: bool = False,
    async_save: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Save every object's ``state_dict()`` to ``path`` (a file, or an fsspec URL) as one checkpoint.

    Atomic (the old file stays until the new one is complete), checksummed, no pickle: values of a
    ``state_dict()`` other than tensors, numbers, strings, bytes, None, lists, tuples, dicts and numpy arrays
    are a TypeError naming their key path, before anything is written. ``async_save=True`` copies the state
    at the call and writes in the background (``handle.wait()``). Under ``torch.distributed`` every rank
    calls it: rank 0 writes the state once; with a ``ZeroRedundancyOptimizer`` every rank writes its shard
    into a rank set named after ``path`` (rank files beside it, ``<path>.manifest.json`` the set's commit
    point), as ``ORTTrainer.save_checkpoint`` does.
    """
    return _save(_IO, state, path, step, user_dict, overwrite, async_save, storage_options)


def load_objects(
    state: Mapping[str, Any], path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Load the objects of ``state`` from ``path`` (a file, a rank set's manifest, or an aggregated file).

    Everything is validated before any object is loaded; a failure leaves every object as it was. Returns
    the ``user_dict`` saved with it (``{}`` if none). A waiting background save of ``save_objects`` is
    finished first.
    """
    _IO.wait()
    return _load(state, path, storage_options)


def _save(io, state, path, step, user_dict, overwrite, async_save, storage_options) -> SaveHandle:
    entries = check_state(state)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return save_objects_to(
        io,
        entries,
        resolve(path, storage_options),
        step=step,
        user_dict=user_dict,
        overwrite=overwrite,
        async_save=bool(async_save),
        group=current_group(),
    )


def _load(state: Mapping[str, Any], path: Any, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    entries = check_state(state)
    group = current_group()
    with local_inputs([path], storage_options) as local:
        full = read_objects(local[0], group)
        return restore_objects(entries, full, str(path))


class ObjectsCheckpointable:
    """A dict of objects as :class:`~ort_trainer.checkpoint.manager.Checkpointable`: what the manager calls
    on a trainer (``save_checkpoint``, ``load_checkpoint``, ``wait_for_checkpoint``, ``all_gather_objects``,
    ``options``, ``train_step_info``), done by :func:`save_objects` / :func:`load_objects` with the
    manager's own background writer ``io``."""

    def __init__(self, state: Mapping[str, Any], io: SaveScheduler) -> None:
        check_state(state)
        self.state, self.io = state, io
        self.group = current_group()
        self.options = SimpleNamespace(
            distributed=SimpleNamespace(world_rank=self.group.rank, world_size=self.group.world_size)
        )
        self.train_step_info = SimpleNamespace(step=None)  # a dict has no step counter: the caller gives it
        self.step = 0

    def save_checkpoint(
        self,
        path: Any,
        *,
        user_dict: Mapping | None = None,
        overwrite: bool = False,
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        return _save(self.io, self.state, path, self.step, user_dict, overwrite, async_save, storage_options)

    def load_checkpoint(self, path: Any, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.io.wait()
        return _load(self.state, path, storage_options)

    def wait_for_checkpoint(self) -> None:
        self.io.wait()

    def all_gather_objects(self, value: Any) -> list[Any]:
        return self.group.all_gather_object(value)
