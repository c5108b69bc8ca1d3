"""Save a custom loop's dict of objects: one tree in our HDF5 format, written by the trainer's own writer.

Every object's ``state_dict()`` is encoded first (the pickle-free user_dict encoding: tensors, numbers,
strings, lists, tuples, dicts, numpy arrays; anything else is a TypeError naming its key path), before
anything is written, so a refused save leaves the previous checkpoint as it was. The tree then goes through
``checkpoint.io.write_checkpoint``: atomic publish, checksums, the background writer for asynchronous saves
(which copies every tensor at the call: a custom loop changes its weights and moments right after it).

Several processes (``torch.distributed`` initialised): without a ZeRO optimizer the ranks hold the same state
(DDP), so **rank 0 writes the whole state once** and the others write nothing; with a
``ZeroRedundancyOptimizer`` every rank writes its file of a rank set (its optimizer shard, its own copy of
the rest) and rank 0 the manifest, as our trainer's ZeRO saves do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointWriteError
from ..format import encode_user_dict, encode_user_value
from ..format import schema as S
from ..format.schema import TrainerOptionsRecord
from ..io import Location, SaveHandle, SaveScheduler, write_checkpoint
from ._group import ProcessGroup
from ._kinds import SHARDED, Entry
from ._zero import shard_key, zero_shard

__all__ = ["objects_tree", "save_objects_to"]


def _encoded(entry: Entry) -> tuple[Any, dict[str, Any]]:
    """(stateful/<name> value, optimizer/ groups) of one object."""
    where = f"{S.STATEFUL_KEY}/{entry.name}"
    if entry.kind != SHARDED:
        return encode_user_value(entry.obj.state_dict(), where), {}
    groups, shard = zero_shard(entry.obj)
    shards = {
        shard_key(entry.name, index): encode_user_value(value, f"{S.OPTIMIZER_KEY}/{shard_key(entry.name, index)}")
        for index, value in shard.items()
    }
    return {"param_groups": encode_user_value(groups, f"{where}/param_groups")}, shards


def objects_tree(
    entries: list[Entry], step: int, user_dict: Mapping | None, group: ProcessGroup, sharded: bool
) -> dict[str, Any]:
    """The tree of one file: the whole state, or (``sharded``) this rank's file of a rank set."""
    if user_dict is not None and not isinstance(user_dict, Mapping):
        raise TypeError(f"user_dict must be a Mapping or None, got {type(user_dict).__name__}")
    world = group.world_size if sharded else 1
    options = TrainerOptionsRecord(
        mixed_precision=False,
        zero_stage=1 if sharded else 0,
        world_rank=group.rank if sharded else 0,
        world_size=world,
        optimizer_name=S.OBJECTS_OPTIMIZER_NAME,
        data_parallel_size=world,
        horizontal_parallel_size=1,
    )
    stateful: dict[str, Any] = {}
    optimizer: dict[str, Any] = {}
    for entry in entries:
        stateful[entry.name], shards = _encoded(entry)
        optimizer.update(shards)
    tree: dict[str, Any] = {
        S.TRAINER_OPTIONS_KEY: options.to_tree(),
        S.TRAIN_STEP_INFO_KEY: {S.TRAIN_STEP_KEY: step},
        S.OBJECTS_KEY: {e.name: {S.OBJECT_KIND_KEY: e.kind, S.OBJECT_TYPE_KEY: e.type} for e in entries},
        S.STATEFUL_KEY: stateful,
    }
    if optimizer:
        tree[S.OPTIMIZER_KEY] = optimizer
    if user_dict:
        tree[S.USER_DICT_KEY] = encode_user_dict(user_dict)
    return tree


def save_objects_to(
    io: SaveScheduler,
    entries: list[Entry],
    target: Location,
    *,
    step: int,
    user_dict: Mapping | None,
    overwrite: bool,
    async_save: bool,
    group: ProcessGroup,
) -> SaveHandle:
    """Write the objects at ``target`` (see the module's docstring for who writes what)."""
    io.wait()
    sharded = group.world_size > 1 and any(e.kind == SHARDED for e in entries)
    if sharded:  # every rank writes its file; write_checkpoint agrees and publishes over the default group
        tree = objects_tree(entries, step, user_dict, group, sharded=True)
        return write_checkpoint(
            io,
            group,
            tree,
            target,
            step=step,
            overwrite=overwrite,
            async_save=async_save,
            distributed_key=(S.DISTRIBUTED_KEY, S.RUN_ID_KEY),
        )
    handle, error = SaveHandle.completed(target.display, []), None
    if group.rank == 0:
        try:
            tree = objects_tree(entries, step, user_dict, group, sharded=False)
            handle = write_checkpoint(
                io,
                None,
                tree,
                target,
                step=step,
                overwrite=overwrite,
                async_save=async_save,
                distributed_key=(S.DISTRIBUTED_KEY, S.RUN_ID_KEY),
            )
        except Exception as exc:  # every rank must hear of it (below) before rank 0 raises it
            error = exc
    outcomes = group.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if outcomes[0] is not None:
        raise CheckpointWriteError(f"rank 0 could not save {target.display}: {outcomes[0]}")
    return handle
