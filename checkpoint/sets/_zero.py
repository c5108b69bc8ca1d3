"""The ZeRO layout of the flat parameter buffer (reference §3.2) and splitting a full state by it.

The trainable parameters, in flat-buffer order, form one buffer of ``total`` elements padded to a
multiple of ``D * 32``; data-parallel rank ``r`` owns ``[r*C, (r+1)*C)`` with ``C = padded // D``.
A parameter inside one rank's range is owned whole by that rank; one that straddles a boundary
is split into 1-D pieces of its flattened moments, each described by a ``partition_info`` entry
with the piece's ``offset``.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..format import schema as S
from ..format.lazy_torch import torch
from ..format.schema import PartitionInfo, TrainerOptionsRecord

__all__ = ["ZeroPiece", "fresh", "full_state_options", "reshard_state", "split_zero", "zero_pieces"]


@dataclass(frozen=True)
class ZeroPiece:
    """The part of one parameter a data-parallel rank owns (``offset`` within the flattened parameter)."""

    name: str
    rank: int
    offset: int
    numel: int
    whole: bool


def zero_pieces(named_numels: Sequence[tuple[str, int]], data_parallel_size: int) -> dict[str, list[ZeroPiece]]:
    """{name: pieces in rank order} for parameters packed in the given order across D ranks.

    An empty parameter is owned whole by the rank whose range contains its start.
    """
    total = sum(n for _, n in named_numels)
    alignment = data_parallel_size * S.ZERO_ALIGNMENT_PER_RANK
    chunk = -(-total // alignment) * alignment // data_parallel_size
    pieces: dict[str, list[ZeroPiece]] = {}
    start = 0
    for name, numel in named_numels:
        if numel == 0:
            owner = min(start // chunk, data_parallel_size - 1) if chunk else 0
            pieces[name] = [ZeroPiece(name, owner, 0, 0, True)]
            continue
        first, last = start // chunk, (start + numel - 1) // chunk
        pieces[name] = [
            ZeroPiece(name, r, lo - start, hi - lo, first == last)
            for r in range(first, last + 1)
            for lo, hi in [(max(start, r * chunk), min(start + numel, (r + 1) * chunk))]
        ]
        start += numel
    return pieces


def full_state_options(state: Any, what: str) -> TrainerOptionsRecord:
    """The trainer options of a full single-process state; ValueError/TypeError saying what is wrong."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{what} needs a full state dict (a Mapping), got {type(state).__name__}")
    model = state.get(S.MODEL_KEY)
    weights = model.get(S.FULL_PRECISION_KEY) if isinstance(model, Mapping) else None
    if S.TRAINER_OPTIONS_KEY not in state or not isinstance(weights, Mapping):
        raise ValueError(
            f"{what} needs a full state dict with '{S.TRAINER_OPTIONS_KEY}' and '{S.MODEL_KEY}/{S.FULL_PRECISION_KEY}' "
            f"(as ORTTrainer.state_dict() returns), got keys {sorted(state)}"
        )
    options = TrainerOptionsRecord.from_tree(state[S.TRAINER_OPTIONS_KEY])
    if options.world_size != 1 or state.get(S.PARTITION_INFO_KEY):
        raise ValueError(
            f"{what} needs a full single-process state, got world_size={options.world_size} and partition_info "
            f"for {sorted(state.get(S.PARTITION_INFO_KEY) or {})}; aggregate the rank states first "
            "(checkpoint.aggregate_states)"
        )
    bad = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise TypeError(f"{what}: model weights must be torch.Tensor, got other values for {bad}")
    return options


def _flat_order(state: Mapping[str, Any], flat_order: Sequence[str] | None) -> list[str]:
    """Validate (or default) the flat-buffer order of the trainable parameters."""
    model = state[S.MODEL_KEY][S.FULL_PRECISION_KEY]
    optimizer = state.get(S.OPTIMIZER_KEY) or {}
    trained = [n for n, e in optimizer.items() if n != S.SHARED_OPTIMIZER_STATE_KEY and isinstance(e, Mapping)]
    order = [n for n in model if n in set(trained)] if flat_order is None else list(flat_order)
    problems = []
    if isinstance(flat_order, str):
        problems.append("flat_order must be a sequence of parameter names, not a str")
    if dups := sorted(n for n, c in Counter(order).items() if c > 1):
        problems.append(f"names listed more than once: {dups}")
    if unknown := sorted(set(order) - set(model)):
        problems.append(f"names that are not model weights: {unknown}")
    if untrained := sorted(set(trained) - set(order)):
        problems.append(f"optimizer entries missing from the order: {untrained}")
    for name in sorted(set(trained) & set(model)):
        sizes = {k: v.numel() for k, v in optimizer[name].items() if k in S.SHARDED_OPTIMIZER_KEYS}
        if any(n != model[name].numel() for n in sizes.values()):
            problems.append(f"'{name}': moments have {sizes} elements, the weight {model[name].numel()}")
    if problems:
        raise ValueError("invalid flat_order / optimizer state: " + "; ".join(problems))
    return order


def fresh(tree: Any) -> Any:
    """New dicts and lists all the way down, the same tensors: rank states must not share containers."""
    if isinstance(tree, Mapping):
        return {k: fresh(v) for k, v in tree.items()}
    return list(tree) if isinstance(tree, list) else tree


def _rank_optimizer(optimizer: Mapping[str, Any], pieces: Mapping[str, list[ZeroPiece]], rank: int) -> dict:
    """This rank's optimizer entries: whole owned entries, 1-D moment pieces, shared state."""
    out: dict[str, Any] = {}
    for name, entry in optimizer.items():
        mine = [p for p in pieces.get(name, ()) if p.rank == rank]
        if name not in pieces or not isinstance(entry, Mapping):
            out[name] = fresh(entry)
        elif mine and mine[0].whole:
            out[name] = fresh(entry)
        elif mine:
            p = mine[0]
            out[name] = {
                k: v.reshape(-1)[p.offset : p.offset + p.numel] if k in S.SHARDED_OPTIMIZER_KEYS else v
                for k, v in entry.items()
            }
    return out


def _rank_partition_info(
    base: Mapping[str, PartitionInfo], pieces: Mapping[str, list[ZeroPiece]], model: Mapping, rank: int
) -> dict:
    """Existing (Megatron) entries, plus an entry with ``offset`` for each piece this rank holds."""
    infos = dict(base)
    for name, parts in pieces.items():
        for p in parts:
            if p.rank == rank and not p.whole:
                old = base.get(name, PartitionInfo(original_dim=tuple(model[name].shape)))
                infos[name] = replace(old, offset=p.offset)
    return {name: info.to_tree() for name, info in infos.items()}


def split_zero(
    state: Mapping[str, Any],
    data_parallel_size: int,
    *,
    zero_stage: int,
    flat_order: Sequence[str] | None = None,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """Split a state (full, or one Megatron rank's) into D ZeRO rank states; keeps its partition_info."""
    for name, value, low in (("world_size", data_parallel_size, 1), ("zero_stage", zero_stage, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    options = TrainerOptionsRecord.from_tree(state[S.TRAINER_OPTIONS_KEY])
    model = state[S.MODEL_KEY][S.FULL_PRECISION_KEY]
    order = _flat_order(state, flat_order)
    pieces = zero_pieces([(n, model[n].numel()) for n in order], data_parallel_size) if zero_stage else {}
    base = {n: PartitionInfo.from_tree(t) for n, t in (state.get(S.PARTITION_INFO_KEY) or {}).items()}
    distributed = {S.RUN_ID_KEY: run_id or uuid.uuid4().hex, S.FLAT_ORDER_KEY: list(order)}
    states = []
    for rank in range(data_parallel_size):
        rank_options = replace(
            options,
            world_rank=rank,
            world_size=data_parallel_size,
            zero_stage=zero_stage,
            data_parallel_size=data_parallel_size,
            horizontal_parallel_size=1,
        )
        out: dict[str, Any] = {}
        for key, value in state.items():
            if key == S.OPTIMIZER_KEY:
                out[key] = _rank_optimizer(value, pieces, rank)
            elif key == S.TRAINER_OPTIONS_KEY:
                out[key] = rank_options.to_tree()
            elif key not in (S.PARTITION_INFO_KEY, S.DISTRIBUTED_KEY):
                out[key] = fresh(value)
        if zero_stage or base:
            out[S.PARTITION_INFO_KEY] = _rank_partition_info(base, pieces, model, rank)
        out[S.DISTRIBUTED_KEY] = dict(distributed)
        states.append(out)
    return states


def reshard_state(
    full_state: Mapping[str, Any],
    world_size: int,
    *,
    zero_stage: int,
    flat_order: Sequence[str] | None = None,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """Split a full single-process state into the ``world_size`` ZeRO rank states a run would save.

    ``flat_order`` is the trainer's flat-buffer order of the trainable parameters (default: the
    model weights that have optimizer entries, in model order). ``zero_stage`` 0 gives every rank
    the whole state (plain data parallel). ``run_id`` defaults to a new uuid. Tensors share memory
    with ``full_state`` (pieces are views): clone before mutating. Inverse of
    :func:`checkpoint.aggregate_states` bit for bit.
    """
    full_state_options(full_state, "reshard_state")
    return split_zero(full_state, world_size, zero_stage=zero_stage, flat_order=flat_order, run_id=run_id)
