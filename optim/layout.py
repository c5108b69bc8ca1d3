"""How named tensors are packed, in order and without padding, into one flat 1-D buffer.

The trainer keeps every trainable parameter (and every gradient) as a view into one contiguous
buffer so that ONNX Runtime can bind them zero-copy and the optimizer can update whole parameter
groups with a few vectorised ops. `FlatLayout` is the single description of that packing: names,
shapes, offsets, views into a buffer, and the contiguous ranges covered by a set of names.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlatLayout", "ParamSlot"]


@dataclass(frozen=True)
class ParamSlot:
    """One tensor in a flat buffer: elements [offset, offset + numel) viewed with `shape`."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the last element of this slot in the flat buffer."""
        return self.offset + self.numel


class FlatLayout:
    """Packs named tensors contiguously, in the given order, into one flat 1-D buffer.

    Args:
        named_shapes: ``[(name, shape), ...]``; shapes are sequences of non-negative ints
            (``torch.Size`` works). Names must be unique.
        align: every slot starts at a multiple of this many elements; the gaps are never read by a
            view, stay zero and update to zero. 1 (the default) packs the tensors back to back. On a
            GPU, kernels need aligned pointers (cuDNN refuses a convolution weight at an odd offset).
    """

    def __init__(self, named_shapes: Iterable[tuple[str, Sequence[int]]], align: int = 1):
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"FlatLayout: align must be a positive int (elements), got {align!r}")
        slots: list[ParamSlot] = []
        offset = 0
        for entry in named_shapes:
            name, shape = _check_entry(entry)
            numel = math.prod(shape)
            offset = -(-offset // align) * align
            slots.append(ParamSlot(name, shape, offset, numel))
            offset += numel
        duplicates = sorted(n for n, k in Counter(s.name for s in slots).items() if k > 1)
        if duplicates:
            raise ValueError(f"FlatLayout: duplicate tensor names {duplicates}; every name must appear once")
        self._slots = tuple(slots)
        self._index = {s.name: s for s in slots}
        self._numel = offset

    @property
    def slots(self) -> tuple[ParamSlot, ...]:
        """The slots, in packing (= offset) order."""
        return self._slots

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names in packing order."""
        return tuple(s.name for s in self._slots)

    @property
    def numel(self) -> int:
        """Total number of elements of the flat buffer."""
        return self._numel

    def __getitem__(self, name: str) -> ParamSlot:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"FlatLayout has no tensor named {name!r} ({len(self)} tensors)") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[ParamSlot]:
        return iter(self._slots)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and self._slots == other._slots

    def __hash__(self) -> int:
        return hash(self._slots)

    def __repr__(self) -> str:
        return f"FlatLayout({len(self)} tensors, numel={self._numel})"

    def check_buffer(self, buffer: torch.Tensor, what: str = "buffer") -> None:
        """Raise ValueError unless `buffer` is a 1-D contiguous tensor of exactly `numel` elements."""
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != self._numel:
            raise ValueError(
                f"{what} must be a 1-D contiguous tensor of {self._numel} elements, got shape "
                f"{tuple(buffer.shape)} (contiguous={buffer.is_contiguous()})"
            )

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `buffer` (sharing its storage) with each tensor's shape, in packing order."""
        self.check_buffer(buffer)
        return {s.name: buffer[s.offset : s.end].view(s.shape) for s in self._slots}

    def runs(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """Merged, sorted ``[start, end)`` element ranges covering the tensors `names`."""
        wanted = set(names)
        unknown = sorted(wanted - self._index.keys())
        if unknown:
            raise KeyError(f"FlatLayout has no tensors named {unknown}")
        ranges: list[tuple[int, int]] = []
        for slot in self._slots:  # offset order
            if slot.name not in wanted or slot.numel == 0:
                continue
            if ranges and ranges[-1][1] == slot.offset:
                ranges[-1] = (ranges[-1][0], slot.end)
            else:
                ranges.append((slot.offset, slot.end))
        return ranges


def _check_entry(entry: object) -> tuple[str, tuple[int, ...]]:
    if not isinstance(entry, tuple | list) or len(entry) != 2:
        raise TypeError(f"FlatLayout entries must be (name, shape) pairs, got {entry!r}")
    name, shape = entry
    if not isinstance(name, str) or not name:
        raise TypeError(f"FlatLayout: tensor names must be non-empty strings, got {name!r}")
    if isinstance(shape, str) or not isinstance(shape, Sequence):
        raise TypeError(f"FlatLayout: shape of {name!r} must be a sequence of ints, got {shape!r}")
    try:
        if any(isinstance(d, bool) for d in shape):
            raise TypeError
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"FlatLayout: shape of {name!r} must contain ints, got {tuple(shape)!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"FlatLayout: shape of {name!r} has a negative dimension: {dims!r}")
    return name, dims
