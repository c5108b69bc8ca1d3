"""Restore a custom loop's dict of objects from a checkpoint: validate everything, then load, or load nothing.

The file (or the rank set, aggregated) is read and its checksums verified; every object's stored state is
decoded (no pickle: a ``__pickle__`` value is refused with ``CheckpointPickleError``) and checked against the
live object: the kind (a module's state goes into a module, an optimizer's into an optimizer of the same
class), a module's keys, shapes and dtypes, an optimizer's parameter groups and their sizes. Only then are
the objects loaded: other objects first, then optimizers, then modules. Should a ``load_state_dict`` raise
all the same (an object of the user's that refuses its state), the objects loaded before it get their
previous ``state_dict()`` back, so a failed restore leaves every object as it was.

Names in the file but not in the state are not loaded (restore the model alone for evaluation); a name of
the state that is not in the file is a KeyError naming what the file holds.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointFormatError
from ..format import decode_user_dict, decode_user_value, open_checkpoint
from ..format import schema as S
from ..format.lazy_torch import is_tensor
from ..sets import aggregate_checkpoints, is_manifest, own_rank_section
from ._group import ProcessGroup
from ._kinds import MODULE, OBJECT, OPTIMIZER, SHARDED, Entry
from ._zero import full_optimizer_state, split_shard_key, zero_shard

__all__ = ["read_objects", "restore_objects"]


def read_objects(path: Any, group: ProcessGroup) -> dict[str, Any]:
    """The full tree of a checkpoint of objects (a file, or a rank set's manifest: aggregated), with this
    rank's own ``stateful`` / ``user_dict`` sections (its own when the set has as many ranks, else rank 0's)."""
    if is_manifest(path):
        full = aggregate_checkpoints(path)
    else:
        with open_checkpoint(path) as reader:
            reader.verify()
            full = reader.read()
    if S.OBJECTS_KEY not in full:
        raise ValueError(
            f"{path} is not a checkpoint of a dict of objects (it has no '{S.OBJECTS_KEY}' group; groups: "
            f"{sorted(full)}): one written by ORTTrainer.save_checkpoint loads with trainer.load_checkpoint, or "
            "CheckpointManager.restore(trainer)"
        )
    for section in (S.STATEFUL_KEY, S.USER_DICT_KEY):
        full[section] = own_rank_section(full, section, group.rank, group.world_size)
    return full


def _stored_kinds(full: Mapping[str, Any], source: str) -> dict[str, tuple[str, str]]:
    """{name: (kind, type)} of the objects the file holds; CheckpointFormatError if the group is malformed."""
    kinds = {}
    objects = full[S.OBJECTS_KEY]
    if not isinstance(objects, Mapping):
        raise CheckpointFormatError(f"{source}: '{S.OBJECTS_KEY}' must be a group")
    for name, meta in objects.items():
        kind = meta.get(S.OBJECT_KIND_KEY) if isinstance(meta, Mapping) else None
        kind_type = meta.get(S.OBJECT_TYPE_KEY) if isinstance(meta, Mapping) else None
        if kind not in S.OBJECT_KINDS or not isinstance(kind_type, str):
            raise CheckpointFormatError(f"{source}: malformed '{S.OBJECTS_KEY}/{name}': {meta!r}")
        kinds[name] = (kind, kind_type)
    return kinds


def _stored_state(full: Mapping[str, Any], name: str, kind: str, source: str) -> Any:
    """The decoded ``state_dict()`` of object ``name`` (a ZeRO optimizer's: its shards united)."""
    stateful = full.get(S.STATEFUL_KEY)
    if not isinstance(stateful, Mapping) or name not in stateful:
        raise CheckpointFormatError(f"{source}: '{S.STATEFUL_KEY}/{name}' is missing (listed in '{S.OBJECTS_KEY}')")
    where = f"{S.STATEFUL_KEY}/{name}"
    state = decode_user_value(stateful[name], where, source=source)
    if kind != SHARDED:
        return state
    if not isinstance(state, Mapping) or "param_groups" not in state:
        raise CheckpointFormatError(f"{source}: '{where}' has no param_groups")
    shards = {}
    for key, value in (full.get(S.OPTIMIZER_KEY) or {}).items():
        parsed = split_shard_key(key)
        if parsed is not None and parsed[0] == name:
            shards[parsed[1]] = decode_user_value(value, f"{S.OPTIMIZER_KEY}/{key}", source=source)
    return full_optimizer_state(state["param_groups"], shards)


_A = {MODULE: "a module", OPTIMIZER: "an optimizer", SHARDED: "a ZeroRedundancyOptimizer", OBJECT: "an object"}


def _check_kind(entry: Entry, stored: tuple[str, str], source: str) -> None:
    kind, stored_type = stored
    wanted = {MODULE: {MODULE}, OPTIMIZER: {OPTIMIZER, SHARDED}, SHARDED: {OPTIMIZER, SHARDED}, OBJECT: {OBJECT}}
    if kind not in wanted[entry.kind]:
        raise ValueError(
            f"cannot restore state[{entry.name!r}] ({entry.type}, {_A[entry.kind]}) from {source}: "
            f"it holds {_A[kind]} ({stored_type}) under that name"
        )
    if entry.kind in (OPTIMIZER, SHARDED) and stored_type != entry.type:
        raise ValueError(
            f"cannot restore state[{entry.name!r}] from {source}: it holds the state of a {stored_type}, "
            f"the optimizer is a {entry.type}"
        )


def _check_module(entry: Entry, state: Any, source: str) -> None:
    """Keys, shapes and dtypes of a module's stored state_dict against the module's own."""
    if not isinstance(state, Mapping):
        raise CheckpointFormatError(f"{source}: '{S.STATEFUL_KEY}/{entry.name}' is not a group of tensors")
    live = entry.obj.state_dict()
    problems = []
    if missing := [k for k in live if k not in state]:
        problems.append(f"missing keys {missing}")
    if unexpected := [k for k in state if k not in live]:
        problems.append(f"unexpected keys {unexpected}")
    for key, value in live.items():
        stored = state.get(key)
        if is_tensor(value) and key in state:
            if not is_tensor(stored) or (stored.shape, stored.dtype) != (value.shape, value.dtype):
                got = f"{tuple(stored.shape)} {stored.dtype}" if is_tensor(stored) else type(stored).__name__
                problems.append(f"'{key}': stored {got}, the module has {tuple(value.shape)} {value.dtype}")
    if problems:
        raise ValueError(f"cannot restore state[{entry.name!r}] ({entry.type}) from {source}: " + "; ".join(problems))


def _check_optimizer(entry: Entry, state: Any, source: str) -> None:
    """Parameter groups, their sizes and the state's parameter indices against the optimizer's own."""
    what = f"cannot restore state[{entry.name!r}] ({entry.type}) from {source}"
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    per_param = state.get("state") if isinstance(state, Mapping) else None
    ok = isinstance(groups, list) and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)
    if not ok or not isinstance(per_param, Mapping):
        raise CheckpointFormatError(f"{what}: the stored state has no valid 'state' and 'param_groups'")
    stored_sizes = [len(g["params"]) for g in groups]
    live_sizes = [len(g["params"]) for g in entry.obj.param_groups]
    if stored_sizes != live_sizes:
        raise ValueError(
            f"{what}: it was saved with {len(groups)} parameter group(s) of {stored_sizes} parameters, the optimizer "
            f"has {len(live_sizes)} of {live_sizes}"
        )
    indices = {i for g in groups for i in g["params"]}
    if bad := sorted(repr(k) for k in per_param if k not in indices):
        raise CheckpointFormatError(f"{what}: state for parameter indices {bad} that no parameter group lists")


def _snapshot(entry: Entry) -> Any:
    """A copy of the object's current state that its ``load_state_dict`` takes back (a ZeRO optimizer's
    ``state_dict()`` needs a collective: its own shard is enough to give it back)."""
    state = full_optimizer_state(*zero_shard(entry.obj)) if entry.kind == SHARDED else entry.obj.state_dict()
    return copy.deepcopy(state)


def _load_all(loads: list[tuple[Entry, Any]]) -> None:
    """``load_state_dict`` each object in order; on a failure give the loaded ones their previous state back."""
    previous: list[tuple[Entry, Any]] = []
    try:
        for entry, state in loads:
            previous.append((entry, _snapshot(entry)))
            entry.obj.load_state_dict(state)
    except BaseException:
        for entry, before in reversed(previous):
            try:
                entry.obj.load_state_dict(before)
            except Exception:  # best effort: the original error is the one to report  # noqa: S110
                pass
        raise


def restore_objects(entries: list[Entry], full: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate every object's stored state, then load them all (or none); return the decoded user_dict."""
    kinds = _stored_kinds(full, source)
    if absent := [e.name for e in entries if e.name not in kinds]:
        raise KeyError(f"{source} holds no object {absent[0]!r}; it holds {sorted(kinds)}")
    states = {}
    for entry in entries:
        _check_kind(entry, kinds[entry.name], source)
        state = _stored_state(full, entry.name, kinds[entry.name][0], source)
        if entry.kind == MODULE:
            _check_module(entry, state, source)
        elif entry.kind in (OPTIMIZER, SHARDED):
            _check_optimizer(entry, state, source)
        states[entry.name] = state
    user = full.get(S.USER_DICT_KEY)
    user_dict = {} if user is None else decode_user_dict(user, source=source)
    order = {OBJECT: 0, OPTIMIZER: 1, SHARDED: 1, MODULE: 2}  # the validated kinds last: least likely to fail
    _load_all(sorted(((e, states[e.name]) for e in entries), key=lambda pair: order[pair[0].kind]))
    return user_dict
