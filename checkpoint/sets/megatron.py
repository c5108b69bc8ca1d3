"""Split a full state into the per-rank states of a Megatron (horizontal parallel) run, and a D x H grid.

Legacy layout (reference §3.2): a column partition (``megatron_row_partition = 0``) splits the
last axis, a row partition (``= 1``) axis 0; ``original_dim`` is the full shape; moments are
split like their weight; everything else (counters, unpartitioned weights) is replicated.
``checkpoint.aggregate_states`` is the inverse. Fused-QKV style strided column partitions are
refused: their slices interleave blocks, so concatenation would not restore the weight.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..format import schema as S
from ..format.lazy_torch import torch
from ..format.schema import PartitionInfo, TrainerOptionsRecord
from ._zero import fresh, full_state_options, split_zero

__all__ = ["partition", "partition_grid"]

_COLUMN, _ROW = 0, 1


def _names(value: Iterable[str], what: str) -> list[str]:
    if isinstance(value, str) or not all(isinstance(n, str) for n in value):
        raise TypeError(f"{what} must be a sequence of weight names, got {value!r}")
    return list(value)


def _strided(strided: Mapping[str, int] | None) -> list[str]:
    """Names declared with stride 1 (plain column partitions); NotImplementedError for stride > 1."""
    strided = dict(strided or {})
    bad = sorted(f"{n}: {s!r}" for n, s in strided.items() if not isinstance(s, int) or isinstance(s, bool) or s < 1)
    if bad:
        raise ValueError(f"strides must be ints >= 1, got {bad}")
    fused = {n: s for n, s in sorted(strided.items()) if s > 1}
    if fused:
        raise NotImplementedError(
            f"strided column partitions are not supported: {fused}. Each rank would hold `stride` interleaved "
            "blocks (e.g. its share of Q, K and V), so concatenating the rank slices along the last axis - what "
            "aggregation does - would scramble the weight. Store Q, K and V as separate weights (plain column "
            "partitions) instead."
        )
    return list(strided)


def _flags(model: Mapping[str, torch.Tensor], column: list[str], row: list[str], H: int) -> dict[str, int]:
    """{name: 0 (column) or 1 (row)}; ValueError listing every unknown, doubly listed or uneven name."""
    problems = []
    if both := sorted(set(column) & set(row)):
        problems.append(f"listed as both column and row partitioned: {both}")
    if doubled := sorted({n for n in column if column.count(n) > 1} | {n for n in row if row.count(n) > 1}):
        problems.append(f"listed more than once: {doubled}")
    if unknown := sorted((set(column) | set(row)) - set(model)):
        problems.append(
            f"not model weights: {unknown} (weights: {sorted(model)[:20]}{'...' if len(model) > 20 else ''})"
        )
    flags = {n: _COLUMN for n in column} | {n: _ROW for n in row}
    for name in sorted(set(flags) & set(model) - set(both)):
        shape = tuple(model[name].shape)
        axis = len(shape) - 1 if flags[name] == _COLUMN else 0
        if not shape:
            problems.append(f"'{name}' is 0-d and has no axis to partition")
        elif shape[axis] % H:
            problems.append(
                f"'{name}' shape {shape}: axis {axis} (size {shape[axis]}) is not divisible by "
                f"horizontal_parallel_size={H}"
            )
    if problems:
        raise ValueError("invalid Megatron partition: " + "; ".join(problems))
    return flags


def _slice(value: Any, flag: int | None, H: int, h: int) -> Any:
    if flag is None or not isinstance(value, torch.Tensor):
        return value
    axis = value.dim() - 1 if flag == _COLUMN else 0
    size = value.shape[axis] // H
    return value.narrow(axis, h * size, size)


def _check_moments(state: Mapping[str, Any], flags: Mapping[str, int]) -> None:
    model, optimizer = state[S.MODEL_KEY][S.FULL_PRECISION_KEY], state.get(S.OPTIMIZER_KEY) or {}
    bad = sorted(
        f"{name}/{key}: {tuple(value.shape)} vs weight {tuple(model[name].shape)}"
        for name in flags
        if isinstance(optimizer.get(name), Mapping)
        for key, value in optimizer[name].items()
        if key in S.SHARDED_OPTIMIZER_KEYS and tuple(value.shape) != tuple(model[name].shape)
    )
    if bad:
        raise ValueError(f"moments of partitioned weights must have the weight's shape: {bad}")


def _rank_state(state: Mapping[str, Any], flags: Mapping[str, int], options: TrainerOptionsRecord, h: int, run_id: str):
    H = options.horizontal_parallel_size
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == S.MODEL_KEY:
            out[key] = {g: {n: _slice(t, flags.get(n), H, h) for n, t in ws.items()} for g, ws in value.items()}
        elif key == S.OPTIMIZER_KEY:
            out[key] = {
                n: {k: _slice(v, flags.get(n) if k in S.SHARDED_OPTIMIZER_KEYS else None, H, h) for k, v in e.items()}
                if isinstance(e, Mapping)
                else fresh(e)
                for n, e in value.items()
            }
        elif key == S.TRAINER_OPTIONS_KEY:
            out[key] = replace(options, world_rank=h).to_tree()
        elif key != S.DISTRIBUTED_KEY:
            out[key] = fresh(value)
    model = state[S.MODEL_KEY][S.FULL_PRECISION_KEY]
    out[S.PARTITION_INFO_KEY] = {
        n: PartitionInfo(original_dim=tuple(model[n].shape), megatron_row_partition=f).to_tree()
        for n, f in flags.items()
    }
    out[S.DISTRIBUTED_KEY] = {S.RUN_ID_KEY: run_id}
    return out


def partition(
    state_dict: Mapping[str, Any],
    horizontal_parallel_size: int,
    *,
    column: Sequence[str] = (),
    row: Sequence[str] = (),
    strided: Mapping[str, int] | None = None,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """The H per-rank states a Megatron run saves, from a full single-process state.

    ``column`` weights are split on their last axis, ``row`` weights on axis 0, their
    ``Moment_1``/``Moment_2`` alike; ``strided={name: stride}`` declares fused (e.g. QKV) column
    partitions: stride 1 is a plain column partition, stride > 1 raises NotImplementedError.
    Each state gets ``partition_info``, ``trainer_options`` (world_rank h, world_size H,
    horizontal_parallel_size H) and ``distributed/run_id``. Tensors are views of ``state_dict``.
    ValueError lists every unknown, doubly listed or unevenly divisible weight.
    """
    H = horizontal_parallel_size
    if not isinstance(H, int) or isinstance(H, bool) or H < 1:
        raise ValueError(f"horizontal_parallel_size must be an int >= 1, got {H!r}")
    options = full_state_options(state_dict, "megatron.partition")
    column = _names(column, "column") + _strided(strided)
    flags = _flags(state_dict[S.MODEL_KEY][S.FULL_PRECISION_KEY], column, _names(row, "row"), H)
    _check_moments(state_dict, flags)
    options = replace(options, world_size=H, horizontal_parallel_size=H, data_parallel_size=1)
    run_id = run_id or uuid.uuid4().hex
    return [_rank_state(state_dict, flags, options, h, run_id) for h in range(H)]


def partition_grid(
    state_dict: Mapping[str, Any],
    data_parallel_size: int,
    horizontal_parallel_size: int,
    *,
    column: Sequence[str] = (),
    row: Sequence[str] = (),
    strided: Mapping[str, int] | None = None,
    zero_stage: int = 1,
    flat_order: Sequence[str] | None = None,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """The D*H rank states of a ZeRO + Megatron run, in rank order (rank = d*H + h).

    Megatron-partition first (:func:`partition`), then split each h column across D data-parallel
    ranks with the ZeRO layout (``checkpoint.reshard_state`` rules, offsets within the h slice).
    """
    D, H = data_parallel_size, horizontal_parallel_size
    run_id = run_id or uuid.uuid4().hex
    columns = partition(state_dict, H, column=column, row=row, strided=strided, run_id=run_id)
    grid: list[dict[str, Any]] = [{} for _ in range(D * H)]
    for h, column_state in enumerate(columns):
        options = TrainerOptionsRecord.from_tree(column_state[S.TRAINER_OPTIONS_KEY])
        for d, rank_state in enumerate(
            split_zero(column_state, D, zero_stage=zero_stage, flat_order=flat_order, run_id=run_id)
        ):
            rank_state[S.TRAINER_OPTIONS_KEY] = replace(
                options,
                world_rank=d * H + h,
                world_size=D * H,
                zero_stage=zero_stage,
                data_parallel_size=D,
                horizontal_parallel_size=H,
            ).to_tree()
            grid[d * H + h] = rank_state
    return grid
