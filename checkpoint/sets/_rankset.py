"""The per-rank states of one distributed save: where they come from, their metadata, the set check.

A :class:`RankSource` is one rank's state, in memory (:class:`StateSource`) or in an open file; the
aggregation logic reads through it only. :func:`read_rank_set` reads each rank's small metadata
(``trainer_options``, ``distributed``, ``train_step_info``) and checks that the sources form one
complete, consistent save, reporting every problem at once, before any tensor is read.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import CheckpointError
from ..format import DatasetInfo, numpy_dtype_name
from ..format import schema as S
from ..format.lazy_torch import is_tensor, torch
from ..format.schema import TrainerOptionsRecord

__all__ = ["AggregationError", "RankMeta", "RankSet", "RankSource", "StateSource", "read_rank_set"]

Key = tuple[str, ...]
_LISTED_MISSING = 64  # missing ranks are listed one by one only up to this many beyond the files present


class AggregationError(CheckpointError):
    """Per-rank checkpoints do not form one complete, consistent save, or their contents disagree."""


class RankSource(Protocol):
    """One rank's state. ``tree()`` is metadata only: a nested dict of :class:`DatasetInfo` leaves."""

    label: str

    def has(self, key: Key) -> bool: ...

    def tree(self) -> Mapping[str, Any]: ...

    def read(self, key: Key) -> Any: ...

    def read_into(self, key: Key, out: torch.Tensor) -> None: ...


def _info(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _info(v) for k, v in value.items()}
    if is_tensor(value):
        return DatasetInfo(tuple(value.shape), value.dtype)
    if isinstance(value, np.ndarray) and numpy_dtype_name(value.dtype) is not None:
        return DatasetInfo(value.shape, numpy_dtype_name(value.dtype))
    return DatasetInfo((), type(value))


class StateSource:
    """A rank state held in memory (the nested dict ``checkpoint.load`` returns)."""

    def __init__(self, state: Mapping[str, Any], label: str) -> None:
        self.state, self.label = state, label

    def _node(self, key: Key) -> Any:
        node: Any = self.state
        for part in key:
            node = node[part]
        return node

    def has(self, key: Key) -> bool:
        try:
            self._node(key)
        except (KeyError, TypeError):
            return False
        return True

    def tree(self) -> Mapping[str, Any]:
        return _info(self.state)

    def read(self, key: Key) -> Any:
        return copy.deepcopy(self._node(key))

    def read_into(self, key: Key, out: torch.Tensor) -> None:
        value = torch.as_tensor(self._node(key))
        if value.shape != out.shape or value.dtype != out.dtype:
            raise AggregationError(
                f"{self.label}: '{'/'.join(key)}' has shape {tuple(value.shape)} dtype {value.dtype}, "
                f"expected {tuple(out.shape)} {out.dtype}"
            )
        out.copy_(value)


@dataclass(frozen=True, kw_only=True)
class RankMeta:
    """The small per-rank metadata the set check compares."""

    label: str
    options: TrainerOptionsRecord
    run_id: str | None = None
    flat_order: tuple[str, ...] | None = None
    train_step_info: tuple[tuple[str, Any], ...] | None = None

    @property
    def rank(self) -> int:
        return self.options.world_rank


@dataclass(frozen=True, kw_only=True)
class RankSet:
    """A validated, complete set: topology, shared identity, and the sources in rank order."""

    options: TrainerOptionsRecord  # rank 0's
    run_id: str | None
    flat_order: tuple[str, ...] | None
    sources: tuple[RankSource, ...]  # sources[r] is rank r

    @property
    def world_size(self) -> int:
        return self.options.world_size

    @property
    def horizontal(self) -> int:
        return self.options.horizontal_parallel_size


def _read_meta(source: RankSource) -> RankMeta:
    """Read one source's metadata; ValueError/TypeError (without the label) if it is malformed."""
    if not source.has((S.TRAINER_OPTIONS_KEY,)):
        raise ValueError(f"has no '{S.TRAINER_OPTIONS_KEY}' group")
    options = TrainerOptionsRecord.from_tree(source.read((S.TRAINER_OPTIONS_KEY,)))
    dist = source.read((S.DISTRIBUTED_KEY,)) if source.has((S.DISTRIBUTED_KEY,)) else {}
    if not isinstance(dist, Mapping):
        raise ValueError(f"'{S.DISTRIBUTED_KEY}' must be a group, got {type(dist).__name__}")
    run_id, order = dist.get(S.RUN_ID_KEY), dist.get(S.FLAT_ORDER_KEY)
    if run_id is not None and not isinstance(run_id, str):
        raise TypeError(f"'{S.DISTRIBUTED_KEY}/{S.RUN_ID_KEY}' must be a str, got {type(run_id).__name__}")
    if order is not None and not (isinstance(order, list | tuple) and all(isinstance(n, str) for n in order)):
        raise TypeError(f"'{S.DISTRIBUTED_KEY}/{S.FLAT_ORDER_KEY}' must be a list of str, got {order!r}")
    steps = source.read((S.TRAIN_STEP_INFO_KEY,)) if source.has((S.TRAIN_STEP_INFO_KEY,)) else None
    if steps is not None and not isinstance(steps, Mapping):
        raise ValueError(f"'{S.TRAIN_STEP_INFO_KEY}' must be a group, got {type(steps).__name__}")
    return RankMeta(
        label=source.label,
        options=options,
        run_id=run_id,
        flat_order=None if order is None else tuple(order),
        train_step_info=None if steps is None else tuple(sorted((k, S.as_scalar(v)) for k, v in steps.items())),
    )


def _where(metas: Sequence[RankMeta]) -> str:
    """'rank 0 (a.h5), rank 2 (c.h5)' sorted by rank, then label."""
    return ", ".join(f"rank {m.rank} ({m.label})" for m in sorted(metas, key=lambda m: (m.rank, m.label)))


_FIELDS: tuple[tuple[str, Callable[[RankMeta], Any]], ...] = (
    (S.WORLD_SIZE_KEY, lambda m: m.options.world_size),
    (S.DATA_PARALLEL_SIZE_KEY, lambda m: m.options.data_parallel_size),
    (S.HORIZONTAL_PARALLEL_SIZE_KEY, lambda m: m.options.horizontal_parallel_size),
    (S.ZERO_STAGE_KEY, lambda m: m.options.zero_stage),
    (S.OPTIMIZER_NAME_KEY, lambda m: m.options.optimizer_name),
    (S.MIXED_PRECISION_KEY, lambda m: m.options.mixed_precision),
    (f"{S.DISTRIBUTED_KEY}/{S.RUN_ID_KEY}", lambda m: m.run_id),
    (f"{S.DISTRIBUTED_KEY}/{S.FLAT_ORDER_KEY}", lambda m: m.flat_order),
    (S.TRAIN_STEP_INFO_KEY, lambda m: None if m.train_step_info is None else dict(m.train_step_info)),
)


def _disagreements(metas: Sequence[RankMeta]) -> dict[str, str]:
    """{field: message} for every field whose value is not the same on all ranks."""
    problems = {}
    for name, get in _FIELDS:
        groups: dict[str, list[RankMeta]] = defaultdict(list)
        for meta in metas:
            groups[repr(get(meta))].append(meta)
        if len(groups) > 1:
            ordered = sorted(groups.items(), key=lambda g: (-len(g[1]), min(m.rank for m in g[1]), g[0]))
            problems[name] = f"{name} differs: " + "; ".join(f"{value} on {_where(ms)}" for value, ms in ordered)
    return problems


def _coverage(metas: Sequence[RankMeta]) -> list[str]:
    """Topology sanity, duplicate and missing ranks (only meaningful when world sizes agree)."""
    opts = metas[0].options
    problems = []
    if opts.data_parallel_size * opts.horizontal_parallel_size != opts.world_size:
        problems.append(
            f"data_parallel_size {opts.data_parallel_size} x horizontal_parallel_size "
            f"{opts.horizontal_parallel_size} != world_size {opts.world_size}"
        )
    by_rank: dict[int, list[RankMeta]] = defaultdict(list)
    for meta in metas:
        by_rank[meta.rank].append(meta)
    for rank in sorted(r for r, ms in by_rank.items() if len(ms) > 1):
        labels = sorted(m.label for m in by_rank[rank])
        problems.append(f"rank {rank} appears {len(labels)} times: {', '.join(labels)}")
    world = opts.world_size  # from the files: never build anything of this size before it is bounded
    present = {rank for rank in by_rank if 0 <= rank < world}
    if len(present) < world and world <= len(metas) + _LISTED_MISSING:
        missing = sorted(set(range(world)) - present)
        problems.append(
            f"missing rank(s) {missing} of world_size {world} (got {_where(metas)}); "
            "pass the file of every rank of the save"
        )
    elif len(present) < world:
        problems.append(
            f"world_size {world} but only {len(metas)} rank file(s) given ({_where(metas)}): "
            f"{world - len(present)} ranks missing; pass the file of every rank of the save"
        )
    return problems


def read_rank_set(sources: Sequence[RankSource]) -> RankSet:
    """Read every source's metadata and check the set; AggregationError listing every problem."""
    if not sources:
        raise AggregationError("no rank checkpoints given: pass the state (or file) of every rank")
    metas, problems = [], []
    for source in sources:
        try:
            metas.append(_read_meta(source))
        except (ValueError, TypeError) as exc:
            problems.append(f"{source.label}: {exc}")
    if not problems:
        differ = _disagreements(metas)
        problems = list(differ.values())
        if not differ.keys() & {S.WORLD_SIZE_KEY, S.DATA_PARALLEL_SIZE_KEY, S.HORIZONTAL_PARALLEL_SIZE_KEY}:
            problems += _coverage(metas)
    if problems:
        raise AggregationError("the rank checkpoints do not form one complete save:\n  - " + "\n  - ".join(problems))
    by_rank = {meta.rank: source for meta, source in zip(metas, sources, strict=True)}
    first = next(m for m in metas if m.rank == 0)
    return RankSet(
        options=first.options,
        run_id=first.run_id,
        flat_order=first.flat_order,
        sources=tuple(by_rank[r] for r in sorted(by_rank)),
    )
