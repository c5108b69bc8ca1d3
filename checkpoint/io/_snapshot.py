"""A host snapshot of a state tree, in one buffer reused from save to save.

An asynchronous save must not read the live training buffers while training changes them, so the tree
is copied first: that copy is the only time the training loop waits. Tensors the caller marks as
deferrable (the weights and optimizer moments, which only the optimizer update changes) may be copied
on the writer's thread instead, while the next forward/backward pass runs; the trainer then waits for
that copy only before its next update, and usually not at all. Large tensors are copied into one
preallocated host buffer (page-locked when the state lives on a GPU, so device-to-host copies run at
full speed) that is reused as long as the layout of the large tensors stays the same; so after the
first save an asynchronous save allocates nothing, and the extra memory it holds is one copy of the
state. Small tensors are cloned; python values are deep-copied (the caller may change them later).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..format.lazy_torch import torch

__all__ = ["HostSnapshot"]

_POOLED_BYTES = 64 << 10  # tensors from this size go into the shared buffer; smaller ones are cloned
_ALIGN = 64  # every tensor starts on a 64-byte boundary of the buffer

Key = tuple[str, ...]


def _leaves(tree: Mapping[str, Any], prefix: Key = ()) -> list[tuple[Key, Any]]:
    out: list[tuple[Key, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.extend(_leaves(value, (*prefix, key)))
        else:
            out.append(((*prefix, key), value))
    return out


def _pooled(value: Any) -> bool:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return False
    return value.numel() * value.element_size() >= _POOLED_BYTES


class HostSnapshot:
    """Copies of trees of tensors into a reusable host buffer; :meth:`take` returns the copied tree."""

    def __init__(self) -> None:
        self._layout: tuple[tuple[Key, tuple[int, ...], torch.dtype], ...] | None = None
        self._buffer: torch.Tensor | None = None
        self._views: dict[Key, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the shared buffer held (0 before the first snapshot)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        """Drop the buffer (the next snapshot allocates a new one)."""
        self._layout, self._buffer, self._views = None, None, {}

    def take(
        self, tree: Mapping[str, Any], defer: Callable[[Key], bool] | None = None
    ) -> tuple[dict[str, Any], Callable[[], None]]:
        """A copy of ``tree`` that no later change of the original can touch (device tensors land on the host).

        Large tensors whose key ``defer(key)`` accepts are not copied yet: the returned ``finish()`` copies
        them (call it before anything changes them). Everything else is copied now.
        """
        leaves = _leaves(tree)
        layout = tuple((key, tuple(v.shape), v.dtype) for key, v in leaves if _pooled(v))
        if layout != self._layout:
            self._allocate(layout, pin=any(v.is_cuda for _, v in leaves if isinstance(v, torch.Tensor)))
        copied: dict[str, Any] = {}
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, value in leaves:
            if key in self._views and _pooled(value):
                snap = self._views[key]
                if defer is not None and defer(key):
                    later.append((snap, value))
                else:
                    _copy([(snap, value)])
            elif isinstance(value, torch.Tensor):
                snap = value.detach().to("cpu", copy=True)
            elif isinstance(value, np.ndarray):
                snap = value.copy()
            else:
                snap = copy.deepcopy(value)
            _insert(copied, key, snap)
        _restore_empty_groups(tree, copied)
        return copied, lambda: _copy(later)

    def _allocate(self, layout, *, pin: bool) -> None:
        self.release()
        offsets, total = [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            total += -(-nbytes // _ALIGN) * _ALIGN
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
        views = {}
        for (key, shape, dtype), offset in zip(layout, offsets, strict=True):
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            views[key] = buffer[offset : offset + nbytes].view(dtype).view(shape)
        self._layout, self._buffer, self._views = layout, buffer, views


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """target.copy_(source) for each pair; device copies are asynchronous, then waited for once."""
    device = False
    for target, source in pairs:
        target.copy_(source, non_blocking=source.is_cuda)
        device |= source.is_cuda
    if device:
        torch.cuda.synchronize()


def _insert(tree: dict[str, Any], key: Key, value: Any) -> None:
    node = tree
    for part in key[:-1]:
        node = node.setdefault(part, {})
    node[key[-1]] = value


def _restore_empty_groups(source: Mapping[str, Any], copied: dict[str, Any]) -> None:
    """Empty mappings have no leaves; keep them in the copy (they are stored as empty groups)."""
    for key, value in source.items():
        if isinstance(value, Mapping):
            node = copied.setdefault(key, {})
            _restore_empty_groups(value, node)
