"""How a trainer's checkpoint is written: now or in the background, one file or one file per rank.

The trainer keeps one :class:`SaveScheduler` (created on its first save): the background writer with
its reusable host snapshot and, for asynchronous distributed saves, a process group of its own.

Synchronous save: the state (views of the live buffers) is written on the calling thread; on W > 1
ranks the agreement (:func:`plan_set_save`) and the publish (:func:`write_set`) use the default group.

Asynchronous save: the calling thread waits for the previous save, agrees on the target with the
other ranks (default group, like any collective of the training loop), copies the state into the host
snapshot, and returns. A background thread writes, checksums, fsyncs and publishes; on W > 1 ranks it
gathers every rank's file report and publishes the manifest over a **separate gloo group** created for
checkpoints: collectives on the default group keep running on the training thread meanwhile, and two
groups never share a connection, so neither can interleave with the other. The group is created the
first time the ranks save asynchronously (all ranks call ``save_checkpoint`` together, so they create
it in the same order).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..format import save_to_checked_target
from ..format.files import check_target
from ._async import AsyncWriter, SaveHandle
from ._location import LocalLocation, Location
from ._set_writer import plan_set_save, write_set
from ._transfer import make_parent_folder, save_tree

__all__ = ["SaveScheduler", "write_checkpoint"]


def _dist():
    """``torch.distributed``, imported on first use: the checkpoint tool's read-only commands never load torch."""
    import torch.distributed

    return torch.distributed


# Every rank's write must finish before the manifest is agreed: as long as torch's default for gloo.
_COORDINATION_TIMEOUT = datetime.timedelta(minutes=30)


class _Collective:
    """``all_gather_object`` over one process group (None: the default group)."""

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group

    def all_gather_object(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        _dist().all_gather_object(gathered, value, group=self.group)
        return gathered


class SaveScheduler:
    """Schedules one owner's saves (a trainer's, a manager's, ``save_objects``'): one at a time, now or on a
    background thread; holds the background writer, its snapshot buffer and (lazily) the checkpoint process
    group of asynchronous distributed saves."""

    def __init__(self) -> None:
        self.writer = AsyncWriter()
        self._group: _Collective | None = None

    def checkpoint_group(self, rank: int, world_size: int) -> _Collective:
        """The gloo group the background threads agree over (created collectively on first use)."""
        if self._group is None:
            group = _dist().new_group(backend="gloo", timeout=_COORDINATION_TIMEOUT)
            self._group = _Collective(rank, world_size, group)
        return self._group

    def check(self) -> None:
        """Raise the error of a finished background save that nobody has been told about (no waiting)."""
        self.writer.check()

    def wait(self) -> None:
        """Wait for the background save (if any) to be published; raise its error."""
        self.writer.wait()

    def wait_for_snapshot(self) -> None:
        """Wait until the background save has copied the buffers it reads (before changing them)."""
        self.writer.wait_for_snapshot()


def _check_single_target(target: Location, overwrite: bool) -> None:
    """What ``checkpoint.save`` would refuse, refused now (not later on the background thread); a missing
    folder is created now, at the call."""
    check_target(
        target.display,
        is_dir=target.is_dir,
        make_parent=lambda: make_parent_folder(target),
        exists=target.exists,
        overwrite=overwrite,
    )


def write_checkpoint(
    io: SaveScheduler,
    ctx: Any,
    state: dict[str, Any],
    target: Location,
    *,
    step: int,
    overwrite: bool,
    async_save: bool,
    distributed_key: tuple[str, str],
    defer: Callable[[tuple[str, ...]], bool] | None = None,
) -> SaveHandle:
    """Write ``state`` at ``target`` (one file; or a rank set on W > 1 ranks), now or in the background.

    The caller has waited for the previous save. ``distributed_key`` = (group, key) under which the
    set's run id is stored in every rank file. ``defer(key)``: tensors an asynchronous save may copy on
    its own thread (the caller waits with ``io.writer.wait_for_snapshot()`` before changing them).
    """
    label = target.display
    target = _pinned(target)
    if ctx is None:
        _check_single_target(target, overwrite)  # the one check of the target, on the calling thread
        if not async_save:
            return SaveHandle.completed(label, _save_one(state, target, overwrite))
        snapshot, finish = io.writer.snapshot.take(state, defer)
        return io.writer.submit(lambda: _save_one(snapshot, target, overwrite), label, prepare=finish)
    default = _Collective(ctx.rank, ctx.world_size)
    plan = plan_set_save(default, target, overwrite)
    group, key = distributed_key
    state[group] = {**(state.get(group) or {}), key: plan.run_id}
    if not async_save:
        return SaveHandle.completed(label, write_set(plan, default, state, step))
    coordination = io.checkpoint_group(ctx.rank, ctx.world_size)
    snapshot, finish = io.writer.snapshot.take(state, defer)
    return io.writer.submit(lambda: write_set(plan, coordination, snapshot, step), label, prepare=finish)


def _pinned(target: Location) -> Location:
    """A relative local path made absolute now: a background save must not follow a later ``os.chdir``."""
    if target.remote or target.path.is_absolute():
        return target
    pinned = LocalLocation(os.path.abspath(target.path))
    pinned.display = target.display
    return pinned


def _save_one(tree: Mapping[str, Any], target: Location, overwrite: bool) -> list[str]:
    """Write one file at the checked ``target``: straight into the atomic writer when it is local."""
    if target.remote:
        save_tree(tree, target, overwrite=overwrite)
    else:
        save_to_checked_target(tree, target.path, overwrite=overwrite)
    return [target.display]
