"""Assemble planned output values, one tensor at a time, comparing replicated copies bit for bit.

ZeRO pieces are read straight into the output's flattened view, Megatron slices into their
narrow()ed region (through a staging buffer when not contiguous). Temporaries (copies being
compared, staging) live in reusable scratch arenas sized for the largest tensor; when streaming,
the output does too, so memory stays at about two tensors however many are written. (Allocating
a fresh tensor per output made glibc's heap grow by one tensor per tensor written: torch's
aligned allocations do not fit the holes freed ones leave once HDF5's small allocations sit between.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..format import schema as S
from ..format.lazy_torch import torch
from ._partition import ConstItem, Copies, Item, Key, Pieces, Plan, RankItem, TensorItem, ValueItem, _fmt
from ._rankset import AggregationError

__all__ = ["assemble", "build_tree", "leaf_count", "output_items"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same_value(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))


class _Scratch:
    """One reusable byte arena per role, each as large as the largest tensor of the plan."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.arenas = max_bytes, {}

    def tensor(self, role: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if role not in self.arenas:
            self.arenas[role] = torch.empty(self.max_bytes, dtype=torch.uint8)
        nbytes = math.prod(shape) * dtype.itemsize
        return self.arenas[role][:nbytes].view(dtype).view(tuple(shape))


def _max_bytes(plan: Plan) -> int:
    sizes = [math.prod(i.shape) * i.dtype.itemsize for i in plan.items if isinstance(i, TensorItem)]
    return max(sizes, default=0)


class _Assembler:
    """Reads and combines each planned tensor; collects every replica mismatch."""

    def __init__(self, plan: Plan, reuse_output: bool) -> None:
        self.sources = plan.ranks.sources
        self.scratch, self.reuse_output = _Scratch(_max_bytes(plan)), reuse_output
        self.mismatches: list[str] = []

    def where(self, ranks: Sequence[int]) -> str:
        return ", ".join(f"rank {r} ({self.sources[r].label})" for r in sorted(ranks))

    def value(self, item: ValueItem) -> Any:
        values = [self.sources[r].read(item.key) for r in item.ranks]
        differ = [r for r, v in zip(item.ranks[1:], values[1:], strict=True) if not _same_value(values[0], v)]
        if differ:
            self.mismatches.append(
                f"'{_fmt(item.key)}' on {self.where(differ)} differs from {self.where(item.ranks[:1])}"
            )
        return values[0]

    def tensor(self, item: TensorItem) -> torch.Tensor:
        if self.reuse_output:
            out = self.scratch.tensor("out", item.shape, item.dtype)
        else:
            out = torch.empty(item.shape, dtype=item.dtype)
        if item.axis is not None and item.stride > 1:  # fused slices: block b of column h -> part b, slot h
            H, part = len(item.columns), item.shape[item.axis] // item.stride
            n = part // H
            for h, column in enumerate(item.columns):
                local = list(item.shape)
                local[item.axis] = n * item.stride
                held = torch.empty(local, dtype=item.dtype)
                self._fill(item.key, column, held)
                for b in range(item.stride):
                    out.narrow(item.axis, b * part + h * n, n).copy_(held.narrow(item.axis, b * n, n))
            return out
        if item.axis is not None:
            n = item.shape[item.axis] // len(item.columns)
            for h, column in enumerate(item.columns):
                self._fill(item.key, column, out.narrow(item.axis, h * n, n))
            return out
        self._fill(item.key, item.columns[0], out)
        for column in item.columns[1:]:
            other = self.scratch.tensor("replica", item.shape, item.dtype)
            self._fill(item.key, column, other)
            if not _same_bits(out, other):
                self.mismatches.append(
                    f"'{_fmt(item.key)}' assembled from {self.where(_ranks(column))} differs from the copy assembled "
                    f"from {self.where(_ranks(item.columns[0]))}"
                )
        return out

    def _fill(self, key: Key, column: Copies | Pieces, target: torch.Tensor) -> None:
        buf = target if target.is_contiguous() else self.scratch.tensor("stage", target.shape, target.dtype)
        if isinstance(column, Pieces):
            flat = buf.view(-1)
            for rank, offset, numel in column.parts:
                self.sources[rank].read_into(key, flat[offset : offset + numel])
        else:
            self.sources[column.ranks[0]].read_into(key, buf)
            differ = []
            for rank in column.ranks[1:]:
                other = self.scratch.tensor("compare", buf.shape, buf.dtype)
                self.sources[rank].read_into(key, other)
                if not _same_bits(buf, other):
                    differ.append(rank)
            if differ:
                self.mismatches.append(
                    f"'{_fmt(key)}' on {self.where(differ)} differs from {self.where(column.ranks[:1])}"
                )
        if buf is not target:
            target.copy_(buf)


def _ranks(column: Copies | Pieces) -> list[int]:
    return list(column.ranks) if isinstance(column, Copies) else [p[0] for p in column.parts]


def output_items(plan: Plan, *, pytorch_format: bool = False) -> list[tuple[Key, Item]]:
    """(output key, item) pairs; ``pytorch_format`` keeps only model weights, keyed by name."""
    if not pytorch_format:
        return [(item.key, item) for item in plan.items]
    prefix = (S.MODEL_KEY, S.FULL_PRECISION_KEY)
    return [(item.key[2:], item) for item in plan.items if item.key[:2] == prefix and len(item.key) == 3]


def leaf_count(plan: Plan, *, pytorch_format: bool = False) -> int:
    """How many values (not groups) the output has."""
    items = output_items(plan, pytorch_format=pytorch_format)
    return sum(not (isinstance(item, ConstItem) and isinstance(item.value, Mapping)) for _, item in items)


def assemble(plan: Plan, *, pytorch_format: bool = False, reuse_output: bool = False) -> Iterator[tuple[Key, Any]]:
    """Yield (key, value) in tree order, a fresh empty dict for each group, reading one tensor at a time.

    With ``reuse_output`` every tensor lives in one reused buffer: it is valid only until the next
    item is requested (for writers that consume each value at once). Raises AggregationError after
    the last item if any replicated value differed between ranks.
    """
    asm = _Assembler(plan, reuse_output)
    for key, item in output_items(plan, pytorch_format=pytorch_format):
        if isinstance(item, ConstItem):
            yield key, {} if isinstance(item.value, Mapping) else item.value
        elif isinstance(item, ValueItem):
            yield key, asm.value(item)
        elif isinstance(item, RankItem):
            yield key, asm.sources[item.rank].read(item.source)
        else:
            yield key, asm.tensor(item)
    if asm.mismatches:
        raise AggregationError(
            "rank checkpoints disagree on values that must be identical:\n  - " + "\n  - ".join(asm.mismatches)
        )


def build_tree(pairs: Iterator[tuple[Key, Any]]) -> dict[str, Any]:
    """Nested dict from (key, value) pairs in tree order."""
    root: dict[str, Any] = {}
    for key, value in pairs:
        parent = root
        for part in key[:-1]:
            parent = parent[part]
        parent[key[-1]] = value
    return root
