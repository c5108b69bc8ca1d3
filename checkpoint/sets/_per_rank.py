"""Sections each rank saves for itself (``user_dict``, ``stateful``): kept per rank when aggregating.

A data loader's position or a sampler's state differs between ranks; aggregation keeps rank 0's under
the usual key (legacy readers expect it there) and, when the ranks' values differ, every rank's under
``rank_user_dicts/<r>`` / ``rank_stateful/<r>``, so none is dropped. Values are compared bit for bit
(they are small: they are read while planning).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..format import schema as S
from ..format.lazy_torch import is_tensor, torch

__all__ = ["own_rank_section", "per_rank_entries", "sections_that_differ"]

Key = tuple[str, ...]


def sections_that_differ(sources: Sequence[Any], flats: Sequence[Mapping[Key, Any]]) -> list[str]:
    """The per-rank target keys (``rank_user_dicts``, ...) of the sections whose values differ between ranks."""
    targets = []
    for section, target in S.PER_RANK_KEYS.items():
        values = [
            src.read((section,)) if (section,) in flat else None for src, flat in zip(sources, flats, strict=True)
        ]
        if any(not _same_tree(values[0], value) for value in values[1:]):
            targets.append(target)
    return targets


def per_rank_entries(
    flats: Sequence[Mapping[Key, Any]], targets: list[str]
) -> list[tuple[Key, int | None, Key | None]]:
    """``(output key, rank, source key)`` for every group (rank None) and value to write, in tree order."""
    entries: list[tuple[Key, int | None, Key | None]] = []
    for section, target in S.PER_RANK_KEYS.items():
        if target not in targets:
            continue
        entries.append(((target,), None, None))
        for rank, flat in enumerate(flats):
            if (section,) not in flat:
                continue
            if flat[(section,)] is not None:  # a leaf (a legacy hex user_dict string)
                entries.append(((target, str(rank)), rank, (section,)))
                continue
            entries.append(((target, str(rank)), None, None))
            for key, info in flat.items():
                if key[0] == section and len(key) > 1:
                    entries.append(((target, str(rank), *key[1:]), None if info is None else rank, key))
    return entries


def own_rank_section(full: dict[str, Any], section: str, rank: int | None, world_size: int | None) -> Any:
    """Pop ``section`` (user_dict / stateful) and its per-rank copies from an aggregated state; return the
    loading rank's own when the set was saved by as many ranks as load it, else rank 0's."""
    per_rank = full.pop(S.PER_RANK_KEYS[section], None)
    value = full.pop(section, None)
    if isinstance(per_rank, Mapping) and rank is not None and len(per_rank) == world_size and str(rank) in per_rank:
        return per_rank[str(rank)]
    return value


def _same_tree(a: Any, b: Any) -> bool:
    """Bit-exact equality of two user_dict trees (tensors by dtype, shape and bytes)."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (
            isinstance(a, Mapping)
            and isinstance(b, Mapping)
            and a.keys() == b.keys()
            and all(_same_tree(a[k], b[k]) for k in a)
        )
    if is_tensor(a) or is_tensor(b):
        return (
            is_tensor(a)
            and is_tensor(b)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return type(a) is type(b) and a == b
