"""`ORTTrainer.save_checkpoint` / `load_checkpoint`: the trainer's state in an HDF5 file.

Saving writes views of the live buffers (no copy of the model) through the atomic `checkpoint.save`;
an asynchronous save copies them into a reusable host snapshot and writes in the background, and a
distributed save writes one file per rank plus a manifest (`checkpoint.io.SaveScheduler`).
Paths may be fsspec URLs (`checkpoint.io`).

Loading is two-phase: open, verify every checksum and validate keys, shapes and types against the
trainer first; only then read tensors straight into the live flat buffers (`read_into`, no
intermediate full copy) and apply the small state (counters, scheduler). A failure in the first
phase leaves the trainer exactly as it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ort_trainer.checkpoint import (
    CheckpointCorruptError,
    CheckpointReader,
    DatasetInfo,
    aggregate_checkpoints,
    decode_user_dict,
    encode_user_dict,
    open_checkpoint,
)
from ort_trainer.checkpoint import io as _io
from ort_trainer.checkpoint.format import schema as S
from ort_trainer.checkpoint.io import SaveScheduler, write_checkpoint
from ort_trainer.checkpoint.sets import is_manifest
from ort_trainer.engine import TrainerState

from ._compose import trainer_state_dict
from ._load import _apply, _validate, load_trainer_state_dict
from ._stateful import encode_stateful, load_stateful, own_rank_section

__all__ = ["check_window_boundary", "checkpoint_io", "load_trainer_checkpoint", "save_trainer_checkpoint"]


def save_trainer_checkpoint(
    trainer: TrainerState,
    path: str | os.PathLike,
    user_dict: Mapping | None,
    include_optimizer_states: bool,
    overwrite: bool,
    *,
    stateful: Mapping[str, Any] | None = None,
    async_save: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> _io.SaveHandle:
    """One file; or, on W > 1 ranks, one file per rank plus a manifest that rank 0 writes last.

    The previous asynchronous save is waited for first (its error is raised here). With ``async_save``
    the state is copied into a host snapshot and written in the background (see ``checkpoint.io.SaveScheduler``).
    """
    if include_optimizer_states:
        check_window_boundary(trainer, path)
    io = checkpoint_io(trainer)
    io.wait()
    if user_dict is not None and not isinstance(user_dict, Mapping):
        raise TypeError(f"user_dict must be a Mapping or None, got {type(user_dict).__name__}")
    target = _io.resolve(path, storage_options)
    state = trainer_state_dict(trainer, copy_tensors=False)
    if not include_optimizer_states:
        state.pop(S.OPTIMIZER_KEY, None)
    if user_dict:
        state[S.USER_DICT_KEY] = encode_user_dict(user_dict)
    # interop: extra Stateful objects (sampler, EMA, ...), encoded before anything is written
    stored_stateful = encode_stateful(stateful)
    if stored_stateful is not None:
        state[S.STATEFUL_KEY] = stored_stateful
    return write_checkpoint(
        io,
        trainer.dist,
        state,
        target,
        step=trainer.train_step_info.step,
        overwrite=overwrite,
        async_save=bool(async_save),
        distributed_key=(S.DISTRIBUTED_KEY, S.RUN_ID_KEY),
        defer=_updated_by_the_optimizer(trainer),
    )


def check_window_boundary(trainer: TrainerState, path: Any) -> None:
    """Refuse to save a resumable checkpoint inside a gradient accumulation window.

    The gradient accumulated since the window's first micro-step lives only in the trainer's buffer (per
    rank, not reshardable); a checkpoint does not hold it, so a run resumed from step k with
    ``k % gradient_accumulation_steps != 0`` would silently apply a different update. The save is refused
    before anything is touched, on every rank alike (they share the step); docs/reproducibility.md.
    """
    accumulation = trainer.options.batch.gradient_accumulation_steps
    step = trainer.train_step_info.step
    done = step % accumulation
    if done:
        boundary = step - done + accumulation
        raise ValueError(
            f"cannot save {path} at step {step}: it is inside "
            f"a gradient accumulation window (gradient_accumulation_steps={accumulation}: {done} of its "
            f"{accumulation} micro-steps done). The gradient accumulated so far is not part of a checkpoint, so a "
            f"run resumed from it would silently take a different update. Save after step {boundary}, when the "
            "window's update has run, or pass include_optimizer_states=False to save the weights alone (a file "
            "that cannot resume the run exactly)"
        )


def _updated_by_the_optimizer(trainer: TrainerState):
    """Keys of the tensors only the optimizer update changes (trainable weights, optimizer state): an
    asynchronous save copies them on its own thread while the next forward/backward runs, and the
    trainer waits for that copy before its next update (`engine._step._update`, through
    `TrainerState.wait_for_snapshot`). Everything else (e.g.
    BatchNorm statistics, written by every training run) is copied during the call."""
    trainable = frozenset(trainer.store.param_views)
    model = (S.MODEL_KEY, S.FULL_PRECISION_KEY)
    return lambda key: key[0] == S.OPTIMIZER_KEY or (key[:2] == model and len(key) == 3 and key[2] in trainable)


def checkpoint_io(trainer: TrainerState) -> SaveScheduler:
    """The trainer's background writer (created on first use)."""
    if trainer.checkpoint_io is None:
        trainer.checkpoint_io = SaveScheduler()
    return trainer.checkpoint_io


def load_trainer_checkpoint(
    trainer: TrainerState,
    paths: Sequence[str | os.PathLike],
    *,
    strict: bool,
    allow_pickle: bool,
    stateful: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a single full checkpoint, or aggregate a per-rank set (files or manifest) first.

    A set saved by W ranks loads into any topology: it is aggregated to the full state, which
    `load_state_dict` re-partitions for this trainer (ZeRO ranks keep their own range). Each rank
    gets back the user_dict (and stateful objects) it saved when the world size is unchanged. Remote
    URLs are downloaded to a temporary local spool first. A background save still running is waited for.
    """
    if len(paths) == 0:
        raise ValueError("load_checkpoint needs at least one path")
    if trainer.checkpoint_io is not None:
        trainer.checkpoint_io.wait()
    with _io.local_inputs(list(paths), storage_options) as local:
        return _load_local(trainer, local, strict=strict, allow_pickle=allow_pickle, stateful=stateful)


def _load_local(
    trainer: TrainerState, paths: Sequence, *, strict: bool, allow_pickle: bool, stateful: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A single file is opened once (its topology is read from that open file): a manager that prunes it after
    the open cannot make the load fail. A per-rank set (several files, a manifest, or one rank's file) is
    aggregated to the full state first."""
    if len(paths) > 1 or is_manifest(paths[0]):
        return _load_set(trainer, paths, strict=strict, allow_pickle=allow_pickle, stateful=stateful)
    with open_checkpoint(paths[0]) as reader:
        if not _is_rank_file(reader, paths[0]):
            return _load_file(trainer, reader, strict=strict, allow_pickle=allow_pickle, stateful=stateful)
    return _load_set(trainer, paths, strict=strict, allow_pickle=allow_pickle, stateful=stateful)


def _load_set(
    trainer: TrainerState, paths: Sequence, *, strict: bool, allow_pickle: bool, stateful: Mapping[str, Any] | None
) -> dict[str, Any]:
    full = aggregate_checkpoints(list(paths) if len(paths) > 1 else paths[0])
    if isinstance(full.get(S.OBJECTS_KEY), Mapping):
        _refuse_objects(paths[0], full[S.OBJECTS_KEY])
    sections = _own_sections(trainer, full)
    user_dict = _decode(sections[S.USER_DICT_KEY], allow_pickle, paths[0])
    undo = load_stateful(stateful, sections[S.STATEFUL_KEY], str(paths[0]))
    _undo_on_error(undo, load_trainer_state_dict, trainer, full, strict=strict)
    return user_dict


def _load_file(
    trainer: TrainerState,
    reader: CheckpointReader,
    *,
    strict: bool,
    allow_pickle: bool,
    stateful: Mapping[str, Any] | None,
) -> dict[str, Any]:
    reader.verify()
    if S.OBJECTS_KEY in reader.keys():
        _refuse_objects(reader.path, reader.tree_info((S.OBJECTS_KEY,)))
    sections = _own_sections(trainer, {k: reader.read(k) for k in _SECTION_KEYS if k in reader.keys()})
    user_dict = _decode(sections[S.USER_DICT_KEY], allow_pickle, reader.path)
    undo = load_stateful(stateful, sections[S.STATEFUL_KEY], str(reader.path))
    if trainer.engine is None or trainer.engine.zero is not None or trainer.horizontal is not None:
        tree = reader.read()
        for key in _SECTION_KEYS:
            tree.pop(key, None)
        _undo_on_error(undo, load_trainer_state_dict, trainer, tree, strict=strict)
        return user_dict
    _undo_on_error(undo, _load_into_engine, trainer, reader, strict)
    return user_dict


# interop: per-rank user_dict / stateful sections and the rollback of stateful objects
_SECTION_KEYS = (S.USER_DICT_KEY, S.RANK_USER_DICTS_KEY, S.STATEFUL_KEY, S.RANK_STATEFUL_KEY)


def _own_sections(trainer: TrainerState, tree: dict) -> dict[str, Any]:
    """This rank's user_dict and stateful group (popped from ``tree``), see `own_rank_section`."""
    ctx = trainer.dist
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (None, None)
    return {key: own_rank_section(tree, key, rank, world) for key in (S.USER_DICT_KEY, S.STATEFUL_KEY)}


def _undo_on_error(undo, load, *args, **kwargs) -> None:
    try:
        load(*args, **kwargs)
    except BaseException:
        undo()
        raise


def _refuse_objects(path: Any, objects: Mapping) -> None:
    """A checkpoint of a custom loop's dict of objects is not a trainer's: say what loads it (before any change)."""
    raise ValueError(
        f"{path} holds a dict of objects {sorted(objects)} (saved by CheckpointManager.save(dict, step) or "
        "checkpoint.objects.save_objects), not an ORTTrainer's state: restore it with "
        "CheckpointManager.restore(dict) or checkpoint.objects.load_objects(dict, path)"
    )


def _is_rank_file(reader: CheckpointReader, path: Any) -> bool:
    """One rank's file of a ZeRO (W > 1) or Megatron set: it loads through aggregation, not on its own."""
    if S.TRAINER_OPTIONS_KEY not in reader.keys():
        return False
    options = reader.read(S.TRAINER_OPTIONS_KEY)
    zero, world, horizontal = (
        _topology_value(options, key, default, path)
        for key, default in ((S.ZERO_STAGE_KEY, 0), (S.WORLD_SIZE_KEY, 1), (S.HORIZONTAL_PARALLEL_SIZE_KEY, 1))
    )
    return (zero > 0 and world > 1) or horizontal > 1


def _topology_value(options: Any, key: str, default: int, path: Any) -> int:
    """One topology field of a file's ``trainer_options``, checked as the aggregation checks it."""
    value = S.as_scalar(options.get(key, default)) if isinstance(options, Mapping) else default
    if not isinstance(value, int) or isinstance(value, bool) or value < min(default, 1):
        raise CheckpointCorruptError(
            f"{path}: invalid trainer_options: {key}: expected an int >= {min(default, 1)}, got {value!r}"
        )
    return value


def _decode(tree: Any, allow_pickle: bool, source: Any) -> dict[str, Any]:
    if tree is None:
        return {}
    return decode_user_dict(tree, allow_pickle=allow_pickle, source=str(source))


def _load_into_engine(trainer: TrainerState, reader: CheckpointReader, strict: bool) -> None:
    """Phase 1: a state whose big tensors are shape-only placeholders is fully validated.
    Phase 2: read the big tensors straight into the live buffers, then apply the rest."""
    keys = reader.keys()
    big = (S.MODEL_KEY, S.OPTIMIZER_KEY, *_SECTION_KEYS)
    state = {key: reader.read(key) for key in keys if key not in big}
    if S.MODEL_KEY in keys:
        state[S.MODEL_KEY] = {S.FULL_PRECISION_KEY: _placeholders(reader, (S.MODEL_KEY, S.FULL_PRECISION_KEY))}
        if (S.MODEL_KEY, S.BUFFERS_KEY) in reader:  # the integer buffers: validated as placeholders, read below
            state[S.MODEL_KEY][S.BUFFERS_KEY] = _entries(reader, (S.MODEL_KEY, S.BUFFERS_KEY))
        if (S.MODEL_KEY, S.EXTRA_STATE_KEY) in reader:  # interop: get_extra_state() values (small)
            state[S.MODEL_KEY][S.EXTRA_STATE_KEY] = reader.read((S.MODEL_KEY, S.EXTRA_STATE_KEY))
    if S.OPTIMIZER_KEY in keys:
        state[S.OPTIMIZER_KEY] = _optimizer_placeholders(reader)
    plan = _validate(trainer, state, strict)
    engine = trainer.engine
    targets = {**engine.param_views, **engine.frozen}
    for name in plan.pop("weights"):
        _read_into(reader, (S.MODEL_KEY, S.FULL_PRECISION_KEY, name), targets[name])
    plan["weights"] = {}
    for name in plan.pop("buffers", {}):
        _read_into(reader, (S.MODEL_KEY, S.BUFFERS_KEY, name), trainer.store.buffers[name])
    if "optimizer" in plan:
        plan["optimizer"] = _read_moments(reader, plan["optimizer"], engine.optimizer.state_dict(copy=False))
    _apply(trainer, plan)


def _optimizer_placeholders(reader: CheckpointReader) -> dict[str, Any]:
    """The optimizer tree with moments as placeholders and the small counters read for real."""
    tree: dict[str, Any] = {}
    for name, entries in reader.tree_info((S.OPTIMIZER_KEY,)).items():
        if not isinstance(entries, dict):
            tree[name] = reader.read((S.OPTIMIZER_KEY, name))
            continue
        tree[name] = {
            key: torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            if key in S.SHARDED_OPTIMIZER_KEYS and isinstance(meta, DatasetInfo)
            else reader.read((S.OPTIMIZER_KEY, name, key))
            for key, meta in entries.items()
        }
    return tree


def _read_moments(reader: CheckpointReader, validated: dict, live: dict) -> dict:
    """Read every moment into the optimizer's live buffers; return what is left (the counters)."""
    rest: dict[str, Any] = {}
    for name, entry in validated.items():
        if not isinstance(entry, dict) or name not in live:
            rest[name] = entry
            continue
        for key in S.SHARDED_OPTIMIZER_KEYS & set(entry):
            _read_into(reader, (S.OPTIMIZER_KEY, name, key), live[name][key])
        rest[name] = {key: value for key, value in entry.items() if key not in S.SHARDED_OPTIMIZER_KEYS}
    return rest


def _placeholders(reader: CheckpointReader, prefix: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Shape/dtype stand-ins (meta tensors) for every tensor under ``prefix``, read without data."""
    info = reader.tree_info(prefix)
    return {name: torch.empty(meta.shape, dtype=meta.dtype, device="meta") for name, meta in info.items()}


def _entries(reader: CheckpointReader, prefix: tuple[str, ...]) -> Any:
    """Like `_placeholders`, for a group that may hold anything: arrays as meta tensors, small python values read,
    subgroups as their description (validation refuses what is not a tensor, naming its key)."""
    info = reader.tree_info(prefix)
    if not isinstance(info, Mapping):
        return reader.read(prefix)
    return {
        name: torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        if isinstance(meta, DatasetInfo) and meta.is_array
        else meta
        if isinstance(meta, Mapping)
        else reader.read((*prefix, name))
        for name, meta in info.items()
    }


def _read_into(reader: CheckpointReader, key: tuple[str, ...], target: torch.Tensor) -> None:
    """Straight into ``target`` when layouts allow (CPU, contiguous, same dtype); else via a small copy."""
    if target.device.type == "cpu" and target.is_contiguous() and reader.tree_info(key).dtype == target.dtype:
        reader.read_into(key, target)
    else:
        target.copy_(reader.read(key))
