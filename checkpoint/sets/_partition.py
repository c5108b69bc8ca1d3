"""Plan the full state of a validated rank set from metadata only (shapes, dtypes, partition_info).

For every output key the plan says where its data lives: whole copies that must agree, ZeRO
pieces placed by ``offset`` (legacy files: in rank order) within one data-parallel group, Megatron
slices concatenated along their axis in ``h`` order (rank = d*H + h). Every problem is collected
and reported at once; ``_assemble`` then reads the data.

Model weights are whole on every rank, except in a legacy ZeRO + mixed-precision save (reference
§3.2): there each fp32 master weight is whole on its owner rank only, or split into 1-D pieces
(listed in the holder's ``partition_info``) across the ranks it straddles.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..format import DatasetInfo
from ..format import schema as S
from ..format.lazy_torch import torch
from ..format.schema import PartitionInfo
from ._per_rank import per_rank_entries, sections_that_differ
from ._rankset import AggregationError, RankSet, RankSource

__all__ = [
    "ConstItem",
    "Copies",
    "Item",
    "Pieces",
    "Plan",
    "RankItem",
    "TensorItem",
    "ValueItem",
    "plan_aggregation",
]

Key = tuple[str, ...]


@dataclass(frozen=True)
class Copies:
    """Whole copies on these ranks: the first is used, the others must be bit-identical."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Pieces:
    """1-D pieces (rank, offset, numel), sorted by offset, tiling the flattened tensor exactly."""

    parts: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class TensorItem:
    key: Key
    shape: tuple[int, ...]
    dtype_name: str  # 'float32': planning needs no torch (verify); ``dtype`` resolves it for assembly
    axis: int | None  # Megatron concat axis; None: every column holds the whole tensor
    columns: tuple[Copies | Pieces, ...]
    stride: int = 1  # fused Megatron slices: each column holds `stride` blocks (partition_info "stride")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)


@dataclass(frozen=True)
class ValueItem:
    key: Key
    ranks: tuple[int, ...]  # a python value, equal on every listed rank


@dataclass(frozen=True)
class ConstItem:
    key: Key
    value: Any  # an empty dict for a group


@dataclass(frozen=True)
class RankItem:
    """One rank's own value (a per-rank user_dict or stateful entry), read whole from that rank."""

    key: Key  # output key: rank_user_dicts/<r>/... or rank_stateful/<r>/...
    rank: int
    source: Key  # the key in that rank's state


Item = TensorItem | ValueItem | ConstItem | RankItem


@dataclass(frozen=True)
class Plan:
    """What to read from which rank for every output key, in tree order (groups first)."""

    ranks: RankSet
    items: tuple[Item, ...]


def _flatten(tree: Mapping[str, Any], prefix: Key = ()) -> dict[Key, Any]:
    """{key path: DatasetInfo or None for a group}, in tree order."""
    flat: dict[Key, Any] = {}
    for name, value in tree.items():
        flat[(*prefix, name)] = None if isinstance(value, Mapping) else value
        if isinstance(value, Mapping):
            flat.update(_flatten(value, (*prefix, name)))
    return flat


def _merge_order(flats: Sequence[dict[Key, Any]]) -> list[Key]:
    """Union of all keys, children right after their group, first-seen order in rank order."""
    children: dict[Key, dict[str, None]] = defaultdict(dict)
    for flat in flats:
        for key in flat:
            children[key[:-1]][key[-1]] = None
    order: list[Key] = []
    stack = [()]
    while stack:
        key = stack.pop()
        order.append(key)
        stack.extend((*key, name) for name in reversed(children.get(key, {})))
    return order[1:]


def _fmt(key: Key) -> str:
    return "/".join(key)


def _is_weight(key: Key) -> bool:
    """model/full_precision/<weight>."""
    return len(key) == 3 and key[0] == S.MODEL_KEY and key[1] == S.FULL_PRECISION_KEY


class _Planner:
    """Builds the plan for one validated rank set, collecting every problem."""

    def __init__(self, rank_set: RankSet) -> None:
        self.rs, self.H = rank_set, rank_set.horizontal
        self.problems: list[str] = []
        self.flats = [_flatten(src.tree()) for src in rank_set.sources]
        self.pinfo = [self._read_pinfo(src) for src in rank_set.sources]
        self._names: dict[str, tuple[tuple[int, ...], int] | None] = {}
        # Legacy ZeRO + mixed precision (reference §3.2): the fp32 master weights are partitioned like
        # the moments, so a weight is whole on its owner only, or 1-D pieces on the ranks it straddles.
        # (Our trainer keeps every weight whole on every rank; those sets plan as whole copies.)
        options = rank_set.options
        self.partitioned_weights = options.mixed_precision and options.zero_stage > 0

    def _read_pinfo(self, src: RankSource) -> dict[str, PartitionInfo]:
        if not src.has((S.PARTITION_INFO_KEY,)):
            return {}
        tree, out = src.read((S.PARTITION_INFO_KEY,)), {}
        for name, entry in tree.items() if isinstance(tree, Mapping) else ():
            try:
                out[name] = PartitionInfo.from_tree(entry)
            except (ValueError, TypeError) as exc:
                self.problems.append(f"{src.label}: {S.PARTITION_INFO_KEY}/{name}: {exc}")
        return out

    def where(self, ranks: Sequence[int]) -> str:
        return ", ".join(f"rank {r} ({self.rs.sources[r].label})" for r in sorted(ranks))

    def plan(self) -> Plan:
        items: list[Item] = []
        per_rank = sections_that_differ(self.rs.sources, self.flats)
        for key in _merge_order(self.flats):
            top = key[0]
            if top in (S.PARTITION_INFO_KEY, S.DISTRIBUTED_KEY) or top in per_rank:
                continue
            if top == S.TRAINER_OPTIONS_KEY:
                items += self._trainer_options() if len(key) == 1 else []
            elif top in S.PER_RANK_KEYS:  # rank 0's as it is (legacy readers expect it); all ranks' below
                items += self._item(key, "rank0") if key in self.flats[0] else []
            else:
                items += self._item(key, "param" if top in (S.MODEL_KEY, S.OPTIMIZER_KEY) else "everywhere")
        items += self._per_rank_items(per_rank)
        self._check_flat_order()
        if self.partitioned_weights:
            self._check_weights_held()
        if self.problems:
            raise AggregationError(
                f"cannot aggregate the {len(self.flats)} rank checkpoints:\n  - " + "\n  - ".join(self.problems)
            )
        return Plan(self.rs, tuple(items))

    def _per_rank_items(self, targets: list[str]) -> list[Item]:
        """Every rank's user_dict (stateful group) under rank_user_dicts/<r> (rank_stateful/<r>), as saved."""
        return [
            ConstItem(key, {}) if rank is None else RankItem(key, rank, source)
            for key, rank, source in per_rank_entries(self.flats, targets)
        ]

    def _trainer_options(self) -> list[Item]:
        single = replace(
            self.rs.options, world_rank=0, world_size=1, zero_stage=0, data_parallel_size=1, horizontal_parallel_size=1
        )
        key = (S.TRAINER_OPTIONS_KEY,)
        return [ConstItem(key, {})] + [ConstItem((*key, k), v) for k, v in single.to_tree().items()]

    def _item(self, key: Key, kind: str) -> list[Item]:
        """Plan one key; kind: 'param' (model/optimizer rules), 'everywhere' (replicated) or 'rank0'."""
        flats = self.flats[:1] if kind == "rank0" else self.flats
        found = {r: flat[key] for r, flat in enumerate(flats) if key in flat}
        owned = kind == "param" and (
            (key[0] == S.OPTIMIZER_KEY and len(key) == 2)  # ZeRO: only on owners
            or (self.partitioned_weights and _is_weight(key))
        )
        if kind != "rank0" and (not owned or key[1] == S.SHARED_OPTIMIZER_STATE_KEY):
            self._check_everywhere(key)
        groups = sorted(r for r, info in found.items() if info is None)
        leaves = {r: info for r, info in found.items() if info is not None}
        if groups and leaves:
            where = f"a group on {self.where(groups)} but a value on {self.where(leaves)}"
            self.problems.append(f"'{_fmt(key)}' is {where}")
            return []
        if groups:
            return [ConstItem(key, {})]
        tensor = self._consensus(key, {r: i.is_array for r, i in leaves.items()}, "is a tensor")
        if tensor is None:
            return []
        columns = self._columns(key, leaves) if kind == "param" else None
        if kind == "param" and columns is None:
            return []
        if not tensor:
            return [ValueItem(key, tuple(sorted(leaves)))]
        dtype = self._consensus(key, {r: i.dtype_name for r, i in leaves.items()}, "dtype")
        if dtype is None:
            return []
        if columns is not None:
            return self._param_item(key, leaves, columns, dtype)
        shape = self._consensus(key, {r: tuple(i.shape) for r, i in leaves.items()}, "shape")
        return [] if shape is None else [TensorItem(key, shape, dtype, None, (Copies(tuple(sorted(leaves))),))]

    def _check_everywhere(self, key: Key) -> None:
        """Record a problem if a rank lacks ``key`` although it has its parent group."""
        missing = [r for r, flat in enumerate(self.flats) if key not in flat and (len(key) == 1 or key[:-1] in flat)]
        if missing:
            self.problems.append(f"'{_fmt(key)}' is missing on {self.where(missing)}")

    def _check_weights_held(self) -> None:
        """Partitioned fp32 weights: every weight with optimizer state or partition_info is on some rank."""
        weights = (S.MODEL_KEY, S.FULL_PRECISION_KEY)
        if not any(weights in flat for flat in self.flats):
            return  # no model weights saved at all (optimizer state only)
        held = {k[2] for flat in self.flats for k in flat if _is_weight(k)}
        claims: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
        for r, flat in enumerate(self.flats):
            for k, info in flat.items():
                if k[0] == S.OPTIMIZER_KEY and len(k) == 2 and info is None and k[1] != S.SHARED_OPTIMIZER_STATE_KEY:
                    claims[k[1]][r].append("optimizer state")
            for name in self.pinfo[r]:
                claims[name][r].append(S.PARTITION_INFO_KEY)
        for name in sorted(set(claims) - held):
            where = ", ".join(f"{' and '.join(what)} on {self.where([r])}" for r, what in sorted(claims[name].items()))
            self.problems.append(
                f"'{_fmt((*weights, name))}' is not held by any rank (with ZeRO and mixed_precision each fp32 "
                f"weight is kept whole by its owner or in 1-D pieces by the ranks it straddles); it has {where}"
            )

    def _check_flat_order(self) -> None:
        """Every trainable parameter (distributed/flat_order) has optimizer state on some rank."""
        held = {k[1] for flat in self.flats for k in flat if k[0] == S.OPTIMIZER_KEY and len(k) == 2}
        if not held - {S.SHARED_OPTIMIZER_STATE_KEY} or self.rs.flat_order is None:
            return  # SGD (no per-parameter state), or no flat order recorded
        missing = sorted(set(self.rs.flat_order) - held)
        if missing:
            self.problems.append(
                f"no rank holds optimizer state for {missing} (listed in {S.DISTRIBUTED_KEY}/{S.FLAT_ORDER_KEY}); "
                "the file of its owner is damaged or from another save"
            )

    def _consensus(self, key: Key, values: Mapping[int, Any], what: str) -> Any:
        """The value all ranks agree on, or None after recording a problem listing every group."""
        groups: dict[Any, list[int]] = defaultdict(list)
        for rank, value in values.items():
            groups[value].append(rank)
        if len(groups) == 1:
            return next(iter(groups))
        parts = sorted(f"{value} on {self.where(ranks)}" for value, ranks in groups.items())
        self.problems.append(f"'{_fmt(key)}': {what} differs between ranks: " + "; ".join(parts))
        return None

    def _columns(self, key: Key, leaves: Mapping[int, DatasetInfo]) -> list[list[int]] | None:
        """Holders per h column (rank = d*H + h); None after a problem if a column holds nothing."""
        columns = [[r for r in sorted(leaves) if r % self.H == h] for h in range(self.H)]
        empty = [h for h, ranks in enumerate(columns) if not ranks]
        if empty:
            W = len(self.flats)
            lacking = [r for h in empty for r in range(h, W, self.H)]
            where = "any rank" if len(empty) == self.H else f"data-parallel group(s) h={empty} ({self.where(lacking)})"
            held = f" (held only by {self.where(leaves)})" if leaves else ""
            self.problems.append(f"'{_fmt(key)}' is not held by {where}{held}")
            return None
        return columns

    def _param_item(
        self, key: Key, leaves: Mapping[int, DatasetInfo], holders: list[list[int]], dtype: str
    ) -> list[Item]:
        name = key[2] if key[0] == S.MODEL_KEY else key[1]
        split = len(key) == 3 and (key[0] == S.MODEL_KEY or key[2] in S.SHARDED_OPTIMIZER_KEYS)
        info = self._name_info(name) if split else None
        if info is False:
            return []
        axis = None
        if info is None:
            shape = self._consensus(key, {r: tuple(i.shape) for r, i in leaves.items()}, "shape")
            if shape is None:
                return []
            local = shape
        else:
            shape, flag, stride = info
            local, axis = self._local_shape(name, shape, flag, stride)
            if local is None:
                return []
        pieces = split and (key[0] == S.OPTIMIZER_KEY or self.partitioned_weights)
        columns = [self._column(key, name, ranks, local, pieces) for ranks in holders]
        if None in columns:
            return []
        if axis is None and all(isinstance(c, Copies) for c in columns):
            columns = [Copies(tuple(sorted(leaves)))]
        return [TensorItem(key, shape, dtype, axis, tuple(columns), stride if axis is not None else 1)]

    def _local_shape(self, name: str, shape: tuple[int, ...], flag: int, stride: int = 1) -> tuple[Any, int | None]:
        """(shape held by one h column, Megatron axis or None) of an entry `_check_name_info` accepted."""
        if flag < 0:
            return shape, None
        axis = len(shape) - 1 if flag == 0 else 0
        return tuple(d // self.H if i == axis else d for i, d in enumerate(shape)), axis

    def _name_info(self, name: str) -> tuple[tuple[int, ...], int] | None | bool:
        """(original_dim, flag) agreed by every rank's partition_info; None if none; False if bad."""
        if name not in self._names:
            self._names[name] = self._check_name_info(name)
        return self._names[name]

    def _check_name_info(self, name: str) -> tuple[tuple[int, ...], int] | None | bool:
        entries = {r: p[name] for r, p in enumerate(self.pinfo) if name in p}
        if not entries:
            return None
        if all(e.stride is None for e in entries.values()):  # legacy entries (no stride: plain slices)
            values = {r: (e.original_dim, e.megatron_row_partition) for r, e in entries.items()}
            agreed = self._consensus((S.PARTITION_INFO_KEY, name), values, "(original_dim, megatron_row_partition)")
            agreed = None if agreed is None else (*agreed, 1)
        else:
            values = {r: (e.original_dim, e.megatron_row_partition, e.stride or 1) for r, e in entries.items()}
            what = "(original_dim, megatron_row_partition, stride)"
            agreed = self._consensus((S.PARTITION_INFO_KEY, name), values, what)
        if agreed is None:
            return False
        problem = _split_problem(*agreed, self.H)
        if problem is not None:
            self.problems.append(f"'{S.PARTITION_INFO_KEY}/{name}' on {self.where(entries)}: {problem}")
            return False
        missing = [r for r in range(len(self.flats)) if r not in entries]
        if agreed[1] >= 0 and missing:
            self.problems.append(
                f"'{S.PARTITION_INFO_KEY}/{name}' (Megatron partitioned) is missing on {self.where(missing)}"
            )
            return False
        return agreed

    def _column(self, key: Key, name: str, ranks: list[int], local: tuple, pieces: bool) -> Copies | Pieces | None:
        """How one h column holds the tensor: whole copies or (if ``pieces``) ZeRO pieces; None after a problem."""
        copies, parts, bad = [], [], []
        for r in ranks:
            shape, info = tuple(self.flats[r][key].shape), self.pinfo[r].get(name) if pieces else None
            if shape == local:
                copies.append(r)
            elif info is not None and len(shape) == 1:
                parts.append((r, info.offset, shape[0]))
            else:
                bad.append(r)
        if bad:
            shapes = "; ".join(f"{tuple(self.flats[r][key].shape)} on {self.where([r])}" for r in bad)
            if pieces or not _is_weight(key):
                expected = f"{local} (or a 1-D ZeRO piece with a partition_info entry)"
            else:
                expected = f"{local} (whole: fp32 weights are ZeRO pieces only with zero_stage > 0 and mixed_precision)"
            self.problems.append(f"'{_fmt(key)}': expected shape {expected}, got {shapes}")
            return None
        if copies and parts:
            self.problems.append(
                f"'{_fmt(key)}' is whole on {self.where(copies)} but ZeRO pieces on {self.where([p[0] for p in parts])}"
            )
            return None
        return self._pieces(key, parts, math.prod(local)) if parts else Copies(tuple(copies))

    def _pieces(self, key: Key, parts: list[tuple[int, Any, int]], numel: int) -> Pieces | None:
        if all(offset is None for _, offset, _ in parts):  # legacy files: pieces in rank order
            starts = [0]
            for _, _, n in parts[:-1]:
                starts.append(starts[-1] + n)
            parts = [(r, start, n) for (r, _, n), start in zip(parts, starts, strict=True)]
        elif any(offset is None for _, offset, _ in parts):
            lacking = [r for r, offset, _ in parts if offset is None]
            self.problems.append(f"'{_fmt(key)}': partition_info has no offset on {self.where(lacking)}")
            return None
        parts = sorted(parts, key=lambda p: (p[1], p[0]))
        issues, pos, last = [], 0, None
        for rank, offset, n in parts:
            if offset > pos:
                issues.append(f"gap [{pos}, {offset})")
            elif offset < pos:
                issues.append(f"ranks {last} and {rank} overlap on [{offset}, {min(pos, offset + n)})")
            pos, last = max(pos, offset + n), rank
        if pos != numel:
            issues.append(f"gap [{pos}, {numel})" if pos < numel else f"pieces end at {pos}, past {numel}")
        if issues:
            pieces = ", ".join(f"{self.where([r])} [{o}, {o + n})" for r, o, n in parts)
            self.problems.append(
                f"'{_fmt(key)}': ZeRO pieces do not tile its {numel} elements: {'; '.join(issues)}; pieces: {pieces}"
            )
            return None
        return Pieces(tuple(parts))


def _split_problem(shape: tuple[int, ...], flag: int, stride: int, H: int) -> str | None:
    """Why a Megatron entry (original_dim ``shape``, megatron_row_partition ``flag``, ``stride``) cannot be
    split into ``H`` parts; None if it can (or is not Megatron partitioned)."""
    if flag < 0:
        return None
    if not shape:
        return (
            f"original_dim [] is 0-d: a Megatron partition (megatron_row_partition={flag}) needs an axis to split "
            "(the full shape of the tensor)"
        )
    axis = len(shape) - 1 if flag == 0 else 0
    size = shape[axis]
    where = f"axis {axis} of original_dim {list(shape)} (size {size})"
    if stride > 1 and size % stride:
        return (
            f"stride {stride} does not divide {where}: a fused (strided) partition stores its axis as {stride} "
            "equal blocks, each split across the ranks"
        )
    if size % (H * stride):
        if stride > 1:
            return (
                f"{where} is not a multiple of horizontal_parallel_size x stride = {H} x {stride} = {H * stride}: "
                f"each of the {stride} blocks is split into {H} parts"
            )
        return f"{where} is not divisible by horizontal_parallel_size={H}"
    return None


def plan_aggregation(rank_set: RankSet) -> Plan:
    """Plan the full state of a validated rank set; AggregationError listing every problem."""
    return _Planner(rank_set).plan()
