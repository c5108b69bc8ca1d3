"""Canonical parameter names: the module's own names, without the prefixes wrappers add.

PyTorch users wrap modules: ``DistributedDataParallel`` and ``DataParallel`` add ``module.``,
``torch.compile`` adds ``_orig_mod.``, activation checkpointing (``checkpoint_wrapper``) adds
``_checkpoint_wrapped_module.`` and FSDP ``_fsdp_wrapped_module.``. Like
``torch.distributed.checkpoint.state_dict`` (``_get_fqns``), the trainer speaks only the names
of the unwrapped module, everywhere: when it discovers parameters, exports, saves and loads.

* `outer_module` drops outer wrappers; `plain_module` gives the plain tree the exporter traces (nested
  wrappers replaced by what they wrap, for the duration of the export).
* `canonical_name` maps a name of the user's (possibly wrapped) module to its canonical name,
  walking the module tree so that a submodule that is really called ``module`` keeps its name.
* `KeyMatcher` maps the keys of a state dict from elsewhere (saved from a DDP or compiled module) to
  the trainer's names: a key is taken as it is when it is known, else with wrapper prefixes stripped;
  two keys that land on one name are an error naming both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch

__all__ = [
    "KeyMatcher",
    "canonical_name",
    "outer_module",
    "plain_module",
    "rename_keys",
    "strip_wrapper_prefixes",
    "wrapper_attribute",
]

_CHECKPOINT = "_checkpoint_wrapped_module"
_COMPILED = "_orig_mod"
_FSDP = "_fsdp_wrapped_module"
_DATA_PARALLEL = "module"
_ANYWHERE = frozenset({_CHECKPOINT, _COMPILED, _FSDP})  # segments no real module name uses


def _wrapper_types() -> list[tuple[type, str]]:
    """(wrapper class, attribute holding the wrapped module), imported lazily (torch.distributed may be absent)."""
    types: list[tuple[type, str]] = [(torch.nn.DataParallel, _DATA_PARALLEL)]
    try:
        from torch.nn.parallel import DistributedDataParallel

        types.append((DistributedDataParallel, _DATA_PARALLEL))
    except ImportError:  # pragma: no cover - torch without distributed support
        pass
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        types.append((OptimizedModule, _COMPILED))
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        types.append((ActivationWrapper, _CHECKPOINT))
    except ImportError:  # pragma: no cover
        pass
    return types


def wrapper_attribute(module: object) -> str | None:
    """The attribute a wrapper module keeps its wrapped module in, or None for an ordinary module."""
    for cls, attribute in _wrapper_types():
        if isinstance(module, cls):
            return attribute
    return None


def _check_not_fsdp(model: torch.nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return
    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if wrapped:
        raise TypeError(
            f"FSDP-wrapped modules cannot be trained by ORTTrainer (found at {wrapped}): FSDP shards parameters "
            "itself; pass the plain module (ORTTrainer shards optimizer state with ZeRO options instead)"
        )


def outer_module(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without its outer wrappers (DDP, DataParallel, torch.compile, checkpoint_wrapper); no copy."""
    _check_not_fsdp(model)
    while (attribute := wrapper_attribute(model)) is not None:
        model = getattr(model, attribute)
    return model


@contextlib.contextmanager
def plain_module(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` with its nested wrappers replaced by what they wrap and ``get_extra_state`` hidden, for tracing;
    put back on exit (``module`` may be the user's own when it cannot be deep-copied).

    The tracer calls ``.detach()`` on every ``state_dict()`` value, and extra state is not tensor state (the
    trainer keeps it, see `_store`): the modules that define ``get_extra_state`` get a subclass without it.
    """
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    classes: list[tuple[torch.nn.Module, type]] = []
    try:
        _replace_nested_wrappers(module, swapped)
        base = torch.nn.Module.get_extra_state
        for sub in module.modules():
            cls = type(sub)
            if getattr(cls, "get_extra_state", base) is not base:
                classes.append((sub, cls))
                hidden = {"get_extra_state": base, "set_extra_state": torch.nn.Module.set_extra_state}
                sub.__class__ = type(cls.__name__, (cls,), hidden)
        yield module
    finally:
        for sub, cls in classes:
            sub.__class__ = cls
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def _replace_nested_wrappers(module: torch.nn.Module, swapped: list | None = None) -> None:
    for name, child in list(module.named_children()):
        inner = child
        while (attribute := wrapper_attribute(inner)) is not None:
            inner = getattr(inner, attribute)
        if inner is not child:
            setattr(module, name, inner)
            if swapped is not None:
                swapped.append((module, name, child))
        _replace_nested_wrappers(inner, swapped)


def canonical_name(model: torch.nn.Module, name: str) -> str:
    """``name`` (a parameter, buffer or ``_extra_state`` key of ``model``) without wrapper segments.

    Walks ``model`` along the name like torch's ``_get_fqns``: a segment is dropped only where the module
    it leads out of is a wrapper and the segment is that wrapper's attribute. Activation-checkpoint
    segments are dropped anywhere (torch does the same).
    """
    parts = [part for part in name.split(".") if part != _CHECKPOINT]
    kept: list[str] = []
    node: object = model
    for i, part in enumerate(parts):
        attribute = wrapper_attribute(node)
        while attribute is not None and attribute != part:  # a wrapper whose prefix its state_dict hooks removed
            node = getattr(node, attribute)
            attribute = wrapper_attribute(node)
        if attribute is not None:  # part == the wrapper's attribute: skip the segment
            node = getattr(node, part)
            continue
        kept.append(part)
        if i < len(parts) - 1:
            node = getattr(node, part, None)
    return ".".join(kept)


def strip_wrapper_prefixes(key: str) -> str:
    """``key`` without segments that only wrappers produce, and without leading ``module.`` segments.

    For keys saved elsewhere (no module to walk): ``module.`` is stripped only at the start, where DDP
    and DataParallel put it; ``_orig_mod.``, ``_checkpoint_wrapped_module.`` and
    ``_fsdp_wrapped_module.`` anywhere.
    """
    parts = [part for part in key.split(".") if part not in _ANYWHERE]
    while len(parts) > 1 and parts[0] == _DATA_PARALLEL:
        parts = [part for part in parts[1:] if part not in _ANYWHERE]
    return ".".join(parts)


class KeyMatcher:
    """Maps keys of an incoming state dict onto known canonical names.

    A key that is a known name is used as it is; otherwise its wrapper prefixes are stripped. Keys that
    match nothing are returned as unexpected. Two incoming keys naming one canonical name raise KeyError
    naming both (say ``module.fc.weight`` next to ``fc.weight``): which one to load would be a guess.
    """

    def __init__(self, known: Iterable[str]):
        self.known = set(known)

    def match(self, keys: Iterable[str], where: str = "state_dict") -> tuple[dict[str, str], list[str]]:
        """``({incoming key: canonical name}, [unexpected keys])``."""
        matched: dict[str, str] = {}
        owner: dict[str, str] = {}
        unexpected: list[str] = []
        for key in keys:
            name = key if key in self.known else strip_wrapper_prefixes(key)
            if name not in self.known:
                unexpected.append(key)
                continue
            if name in owner:
                first, second = sorted((owner[name], key), key=lambda k: (k != name, k), reverse=True)
                raise KeyError(
                    f"{where}: keys {first!r} and {second!r} both name parameter {name!r} once wrapper "
                    "prefixes (module., _orig_mod., _checkpoint_wrapped_module.) are removed; keep only one"
                )
            owner[name] = key
            matched[key] = name
        return matched, unexpected


def rename_keys(state: Mapping[str, object], matched: Mapping[str, str]) -> dict[str, object]:
    """``state`` with every matched key renamed to its canonical name (unmatched keys dropped)."""
    return {matched[key]: value for key, value in state.items() if key in matched}
