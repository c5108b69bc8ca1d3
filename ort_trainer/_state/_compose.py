"""Compose the trainer's state dict: the legacy layout, or ``{fqn: tensor}`` for the torch module.

Every stateful part follows one protocol, ``state_dict() -> dict`` / ``load_state_dict(dict)``; the
trainer's dict is composed from them here, from the `ParamStore` (complete from construction on).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ort_trainer.checkpoint.format import encode_user_value
from ort_trainer.checkpoint.format import schema as S
from ort_trainer.engine import TrainerState

from ..graph import canonical_name
from . import _ranks
from ._options import StateDictOptions, resolve_options

__all__ = ["select_submodules", "trainer_state_dict"]


def trainer_state_dict(
    trainer: TrainerState,
    pytorch_format: bool = False,
    copy_tensors: bool = True,
    *,
    options: StateDictOptions | Any = None,
    submodules: Iterable[str | torch.nn.Module] | None = None,
) -> dict:
    """Legacy-layout state (or ``{fqn: tensor}`` with ``pytorch_format``); tensors are copies unless
    ``copy_tensors=False`` (internal, for saving). See `StateDictOptions` for ``options``."""
    opts = resolve_options(options)
    prefixes = select_submodules(trainer, submodules)
    if pytorch_format:
        state: dict = _pytorch_state(trainer)
    else:
        state = _legacy_state(trainer, copy_tensors, opts.full_state_dict)
    if opts.ignore_frozen_params:
        state = _without_frozen(trainer, state, pytorch_format)
    if prefixes is not None:
        state = _only_submodules(state, prefixes, opts.keep_submodule_prefixes, pytorch_format)
    if opts.cpu_offload:
        dist = trainer.store.dist
        if opts.full_state_dict and dist is not None and dist.rank != 0:
            return {}  # torch's rule: with a full state offloaded to the CPU, only rank 0 holds it
        state = _map_tensors(state, lambda t: t.cpu())
    return state


def _legacy_state(trainer: TrainerState, copy_tensors: bool, full: bool) -> dict[str, Any]:
    store = trainer.store
    clone = _clone if copy_tensors else (lambda t: t.detach())
    model: dict[str, Any] = {S.FULL_PRECISION_KEY: {k: clone(v) for k, v in store.weights.items()}}
    buffers = store.persistent_buffers  # integer buffers (a step counter, num_batches_tracked): resumed runs need them
    if buffers:
        model[S.BUFFERS_KEY] = {k: clone(v) for k, v in buffers.items()}
    if store.extra_state:
        model[S.EXTRA_STATE_KEY] = {name: _storable(name, value) for name, value in store.extra_state.items()}
    state: dict[str, Any] = {S.MODEL_KEY: model}
    if full and store.zero is not None:
        state[S.OPTIMIZER_KEY] = _ranks.full_optimizer_state(store)
    else:
        state[S.OPTIMIZER_KEY] = store.optimizer.state_dict(copy=copy_tensors)
        if store.zero is not None:
            state[S.PARTITION_INFO_KEY] = store.zero.partition_info()
    if trainer.horizontal is not None:  # Megatron: this rank's slices of the split weights (legacy partition_info)
        state[S.PARTITION_INFO_KEY] = trainer.horizontal.combined_partition_info(state.get(S.PARTITION_INFO_KEY, {}))
    state[S.TRAINER_OPTIONS_KEY] = _trainer_options(trainer, single=full)
    state[S.TRAIN_STEP_INFO_KEY] = trainer.train_step_info.state_dict()
    if trainer.options.lr_scheduler is not None:
        state[S.LR_SCHEDULER_KEY] = trainer.options.lr_scheduler.state_dict()
    if trainer.options.mixed_precision.enabled:
        state[S.LOSS_SCALER_KEY] = trainer.options.mixed_precision.loss_scaler.state_dict()
    return state


def _storable(name: str, value: Any) -> Any:
    """``get_extra_state()`` values in the user_dict encoding (no pickle); as they are if that is impossible
    (``save_checkpoint`` then names the key)."""
    try:
        return encode_user_value(value, f"{S.MODEL_KEY}/{S.EXTRA_STATE_KEY}/{name}")
    except TypeError:
        return copy.deepcopy(value)


def _trainer_options(trainer: TrainerState, single: bool = False) -> dict[str, Any]:
    """``trainer_options``; ``single``: as a one-process state (what aggregating a save gives)."""
    dist = trainer.options.distributed
    options = {
        S.MIXED_PRECISION_KEY: bool(trainer.options.mixed_precision.enabled),
        S.ZERO_STAGE_KEY: int(dist.deepspeed_zero_optimization.stage),
        S.WORLD_RANK_KEY: int(dist.world_rank),
        S.WORLD_SIZE_KEY: int(dist.world_size),
        S.OPTIMIZER_NAME_KEY: trainer.optim_config.name,
        S.DATA_PARALLEL_SIZE_KEY: int(dist.data_parallel_size),
        S.HORIZONTAL_PARALLEL_SIZE_KEY: int(dist.horizontal_parallel_size),
    }
    if single and trainer.store.dist is not None:
        for key in (S.ZERO_STAGE_KEY, S.WORLD_RANK_KEY):
            options[key] = 0
        for key in (S.WORLD_SIZE_KEY, S.DATA_PARALLEL_SIZE_KEY, S.HORIZONTAL_PARALLEL_SIZE_KEY):
            options[key] = 1
    return options


def _pytorch_state(trainer: TrainerState) -> dict[str, Any]:
    """``{fqn: value}`` in the module's ``state_dict()`` order, accepted by its ``load_state_dict(strict=True)``."""
    store = trainer.store
    module_state = store.state
    weights = store.weights
    result: dict[str, Any] = {}
    for fqn in module_state.order:
        if fqn in store.extra_state:
            result[fqn] = copy.deepcopy(store.extra_state[fqn])
            continue
        initial = module_state.initial[fqn]
        name = module_state.aliases.get(fqn)
        buffer = store.buffers.get(module_state.buffer_aliases.get(fqn, ""))  # an integer buffer: its value now
        if name in weights:
            result[fqn] = _clone(weights[name]).to(initial.dtype).cpu()
        elif buffer is not None:  # num_batches_tracked too: written by the graph, or counted (`count_batch`)
            result[fqn] = _clone(buffer).cpu()
        elif fqn.endswith("num_batches_tracked"):
            result[fqn] = initial + store.batches_tracked
        else:
            result[fqn] = _clone(initial)
    return result


def _without_frozen(trainer: TrainerState, state: dict, pytorch_format: bool) -> dict:
    store = trainer.store
    frozen = set(store.frozen_parameters)
    if pytorch_format:
        return {k: v for k, v in state.items() if store.state.aliases.get(k) not in frozen}
    state = dict(state)
    model = dict(state[S.MODEL_KEY])
    model[S.FULL_PRECISION_KEY] = {k: v for k, v in model[S.FULL_PRECISION_KEY].items() if k not in frozen}
    state[S.MODEL_KEY] = model
    return state


def select_submodules(trainer: TrainerState, submodules: Iterable[Any] | None) -> list[str] | None:
    """Canonical name prefixes of ``submodules`` (names, or module objects of the trainer's module)."""
    if submodules is None:
        return None
    if isinstance(submodules, str | torch.nn.Module):
        submodules = [submodules]
    known = _module_names(trainer.model) if isinstance(trainer.model, torch.nn.Module) else {}
    prefixes = []
    for item in submodules:
        name = known.get(id(item)) if isinstance(item, torch.nn.Module) else item
        if not isinstance(name, str) or name not in known.values():
            shown = type(item).__name__ if isinstance(item, torch.nn.Module) else repr(item)
            raise ValueError(
                f"submodules: {shown} is not a submodule of the trainer's model; known: {sorted(known.values())}"
            )
        prefixes.append(name)
    return prefixes


def _module_names(model: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for raw, module in model.named_modules():
        name = canonical_name(model, raw) if raw else ""
        if name and id(module) not in names:
            names[id(module)] = name
    return names


def _only_submodules(state: dict, prefixes: list[str], keep_prefixes: bool, pytorch_format: bool) -> dict:
    def pick(tree: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            for prefix in prefixes:
                if key.startswith(prefix + "."):
                    out[key if keep_prefixes else key[len(prefix) + 1 :]] = value
                    break
        return out

    if pytorch_format:
        return pick(state)
    state = dict(state)
    model = dict(state[S.MODEL_KEY])
    for section in (S.FULL_PRECISION_KEY, S.BUFFERS_KEY, S.EXTRA_STATE_KEY):
        if section in model:
            model[section] = pick(model[section])
    state[S.MODEL_KEY] = model
    optimizer = state.get(S.OPTIMIZER_KEY, {})
    shared = {k: v for k, v in optimizer.items() if k == S.SHARED_OPTIMIZER_STATE_KEY}
    state[S.OPTIMIZER_KEY] = {**pick(optimizer), **shared}
    return state


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return fn(tree) if isinstance(tree, torch.Tensor) else tree
