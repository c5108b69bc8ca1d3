"""Extra objects in checkpoints (``save_checkpoint(stateful=...)``) and per-rank sections of aggregated sets.

Any object with ``state_dict()`` / ``load_state_dict(d)`` (a data sampler, an EMA, a metric tracker)
is stored under ``stateful/<name>`` in the user_dict encoding: no pickle, int-keyed dicts, tensors,
numpy arrays and Generator states included. On load every named object must be in the file; the
objects are loaded before the trainer, and if one of them fails (or the trainer's own load fails
afterwards), those already loaded get their previous ``state_dict()`` back: a failed load leaves
everything as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ort_trainer.checkpoint.format import decode_user_value, encode_user_value
from ort_trainer.checkpoint.format import schema as S
from ort_trainer.checkpoint.sets import own_rank_section

__all__ = ["encode_stateful", "load_stateful", "own_rank_section"]


def _check(stateful: Any) -> Mapping[str, Any]:
    if not isinstance(stateful, Mapping):
        raise TypeError(f"stateful must be a dict of name -> object, got {type(stateful).__name__}")
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"stateful keys must be non-empty str, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"stateful[{name!r}] must have state_dict() and load_state_dict(), got {type(obj).__name__}"
            )
    return stateful


def encode_stateful(stateful: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{name: encoded state_dict()}`` for the ``stateful`` group, or None when there is nothing to store."""
    if not stateful:
        return None
    objects = _check(stateful)
    return {name: encode_user_value(obj.state_dict(), f"{S.STATEFUL_KEY}/{name}") for name, obj in objects.items()}


def load_stateful(stateful: Mapping[str, Any] | None, stored: Any, source: str) -> Callable[[], None]:
    """Load every object from the stored group; returns an undo that gives them their previous state back."""
    if not stateful:
        return lambda: None
    objects = _check(stateful)
    stored = stored if isinstance(stored, Mapping) else {}
    absent = [name for name in objects if name not in stored]
    if absent:
        raise KeyError(f"stateful[{absent[0]!r}] is not in {source}; stored: {sorted(stored)}")
    decoded = {name: decode_user_value(stored[name], f"{S.STATEFUL_KEY}/{name}", source=source) for name in objects}
    previous: dict[str, Any] = {}

    def undo() -> None:
        for name, state in previous.items():
            try:
                objects[name].load_state_dict(state)
            except Exception:  # best effort: the original error is the one to report
                pass

    try:
        for name, obj in objects.items():
            previous[name] = copy.deepcopy(obj.state_dict())
            obj.load_state_dict(decoded[name])
    except BaseException:
        undo()
        raise
    return undo
