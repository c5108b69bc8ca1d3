"""What each object of a custom loop's state is: a module, a torch optimizer, a ZeRO optimizer, or anything else.

The kind decides where its ``state_dict()`` goes and what is checked before it is loaded
(docs/custom_loop_checkpoints.md).
Wrappers are looked through as DCP's ``get_state_dict`` does: a ``DistributedDataParallel``, ``DataParallel`` or
``torch.compile`` module saves and loads the keys of the module it wraps, so a checkpoint written under DDP loads
into the plain module and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ..format import schema as S
from ..format.lazy_torch import torch

__all__ = ["Entry", "check_state", "type_name", "unwrap"]

MODULE, OPTIMIZER, SHARDED, OBJECT = S.OBJECT_KINDS


class Entry(NamedTuple):
    """One object of the state: its name, the object itself (unwrapped), its kind and its type's name."""

    name: str
    obj: Any
    kind: str
    type: str


def type_name(obj: Any) -> str:
    """``module.QualifiedName`` of ``obj``'s class (the optimizer class a ZeRO optimizer runs, for a ZeRO)."""
    cls = type(obj.optim) if _is_zero(obj) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def unwrap(module: Any) -> Any:
    """The module a DDP / DataParallel / ``torch.compile`` wrapper holds (repeatedly); others as they are."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and isinstance(
            getattr(module, "_orig_mod", None), torch.nn.Module
        ):
            module = module._orig_mod
        else:
            return module


def _is_zero(obj: Any) -> bool:
    if not isinstance(obj, torch.optim.Optimizer) or not torch.distributed.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(obj, ZeroRedundancyOptimizer)


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.nn.Module):
        return MODULE
    if _is_zero(obj):
        return SHARDED
    if isinstance(obj, torch.optim.Optimizer):
        return OPTIMIZER
    return OBJECT


def check_state(state: Any) -> list[Entry]:
    """The entries of ``state`` (a dict of name -> object with ``state_dict()`` / ``load_state_dict()``).

    TypeError naming the first bad name or object; nothing is called on any object.
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a dict of name -> object with state_dict()/load_state_dict(), got {type(state).__name__}"
        )
    if not state:
        raise ValueError("state is empty: give at least one object, e.g. {'model': model, 'optimizer': optimizer}")
    entries = []
    for name, obj in state.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state keys must be non-empty str, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"state[{name!r}] must have state_dict() and load_state_dict() (torch's Stateful protocol), "
                f"got {type(obj).__module__}.{type(obj).__qualname__}"
            )
        kind = _kind(obj)
        target = unwrap(obj) if kind == MODULE else obj
        entries.append(Entry(name, target, kind, type_name(target)))
    return entries
