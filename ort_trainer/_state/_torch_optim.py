"""The trainer's optimizer state in ``torch.optim``'s format: `optimizer_state_dict` / `load_optimizer_state_dict`.

The conversion itself is `optim.torch_format`; here the trainer's side: parameter names (canonical,
wrapper prefixes stripped), the int keys of ``Optimizer.state_dict()``, ZeRO (the full state is
gathered) and the step counters (loading torch's ``step`` N sets ``optimization_step`` to N, so
every ``Update_Count`` is N + 1 and LR schedules continue where torch stopped).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ort_trainer.checkpoint.format import schema as S
from ort_trainer.engine import TrainerState
from ort_trainer.optim.torch_format import check_torch_expressible, from_torch_state, to_torch_state

from ..graph import KeyMatcher, canonical_name
from . import _ranks
from ._load import load_trainer_state_dict
from ._options import StateDictOptions, resolve_options

__all__ = ["load_optimizer_state_dict", "optimizer_state_dict"]


def optimizer_state_dict(trainer: TrainerState, options: StateDictOptions | Any = None) -> dict[str, Any]:
    """``{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}`` (torch.optim.AdamW/SGD)."""
    opts = resolve_options(options)
    store = trainer.store
    check_torch_expressible(trainer.optim_config)
    if store.zero is not None and not opts.full_state_dict:
        raise ValueError(
            "under ZeRO every rank holds part of the optimizer state: pass "
            "options=StateDictOptions(full_state_dict=True) on every rank (it gathers the state)"
        )
    legacy = _ranks.full_optimizer_state(store) if store.zero is not None else store.optimizer.state_dict()
    if opts.cpu_offload and opts.full_state_dict and store.dist is not None and store.dist.rank != 0:
        return {}
    result = to_torch_state(trainer.optim_config, store.layout.names, legacy, _current_lr(trainer))
    if opts.cpu_offload:
        for entry in result["state"].values():
            for key, value in entry.items():
                entry[key] = value.cpu()
    return result


def _current_lr(trainer: TrainerState) -> float:
    scheduler = trainer.options.lr_scheduler
    if scheduler is None:
        return float(trainer.optim_config.lr)
    return float(scheduler.get_lr(trainer.train_step_info))


def load_optimizer_state_dict(
    trainer: TrainerState,
    state: Mapping[str, Any],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> _IncompatibleKeys:
    """Load torch's optimizer state (fqn keys, or int keys with ``model`` / ``optimizer``); validate first."""
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        raise TypeError("optimizer state must be a dict with 'state' and 'param_groups' (torch.optim's format)")
    check_torch_expressible(trainer.optim_config)
    store = trainer.store
    names = _index_names(trainer, state, model, optimizer)
    renamed = _canonical(trainer, state, names)
    shapes = {name: tuple(store.layout[name].shape) for name in store.layout.names}
    legacy, updates, missing, unexpected = from_torch_state(trainer.optim_config, shapes, renamed, strict=strict)
    if updates is None:
        return _IncompatibleKeys(missing, unexpected)
    accumulation = trainer.options.batch.gradient_accumulation_steps
    loaded = {
        S.OPTIMIZER_KEY: legacy,
        S.TRAIN_STEP_INFO_KEY: {"optimization_step": updates, "step": updates * accumulation},
    }
    load_trainer_state_dict(trainer, loaded, strict=False)
    return _IncompatibleKeys(missing, unexpected)


def _index_names(
    trainer: TrainerState, state: Mapping, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[int, str] | None:
    """For int-keyed states (``Optimizer.state_dict()``): parameter index -> canonical name."""
    groups = state["param_groups"]
    ids = [p for g in groups if isinstance(g, Mapping) for p in g.get("params", [])]
    if not any(isinstance(i, int) for i in [*ids, *state["state"]]):
        return None
    if model is None:
        raise ValueError(
            "this optimizer state has int keys (Optimizer.state_dict()): pass model= (and optimizer=, unless the "
            "groups list the parameters in model order) so they can be named, or use "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)"
        )
    by_id = {}
    for raw, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), canonical_name(model, raw))
    if optimizer is not None:
        ordered = [by_id.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
        return dict(enumerate(ordered))
    return _by_model_order(trainer, groups, by_id, model)


def _by_model_order(trainer: TrainerState, groups: Sequence, by_id: dict, model: torch.nn.Module) -> dict[int, str]:
    """Torch group g numbers our group g's parameters in model order (how AdamW(model.parameters()) does)."""
    store = trainer.store
    ours: dict[int, list[str]] = {}
    for name in store.layout.names:
        ours.setdefault(trainer.optim_config.group_index(name), []).append(name)
    ordered = [ours[k] for k in sorted(ours)]
    sizes = [len(g.get("params", [])) for g in groups]
    if sizes != [len(g) for g in ordered]:
        raise ValueError(
            f"cannot name the int keys of this optimizer state: its param_groups hold {sizes} parameters, this "
            f"trainer's groups {[len(g) for g in ordered]}; pass optimizer= (the torch optimizer) as well"
        )
    return {
        index: name
        for group, names in zip(groups, ordered, strict=True)
        for index, name in zip(group["params"], names, strict=True)
    }


def _canonical(trainer: TrainerState, state: Mapping, names: dict[int, str] | None) -> dict[str, Any]:
    """``state`` with every parameter key as the trainer's canonical name (aliases and prefixes resolved)."""
    module = trainer.store.state
    matcher = KeyMatcher(module.aliases)

    def rename(key: Any) -> Any:
        if names is not None and isinstance(key, int):
            key = names.get(key, key)
        if not isinstance(key, str):
            return key
        matched, _ = matcher.match([key], "optimizer_state_dict")
        return module.aliases[matched[key]] if key in matched else key

    entries = {}
    for key, value in state["state"].items():
        name = rename(key)
        if name in entries:
            raise KeyError(f"optimizer_state_dict['state']: two entries name parameter {name!r}")
        entries[name] = value
    groups = [
        {**g, "params": [rename(p) for p in g.get("params", [])]} if isinstance(g, Mapping) else g
        for g in state["param_groups"]
    ]
    return {"state": entries, "param_groups": groups}
