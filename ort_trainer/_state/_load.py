"""Load a state dict into the trainer, in two phases, the same before and after the first step.

`_validate` reads everything and raises before anything is touched (keys, shapes, dtypes, values,
optimizer name, counters); `_apply` then copies in place into the live buffers. Because the state
exists from construction (`_store.ParamStore`), nothing is ever left pending for the first step.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.modules.module import _IncompatibleKeys

from ort_trainer.checkpoint.format import decode_user_value, encode_user_value
from ort_trainer.checkpoint.format import schema as S
from ort_trainer.engine import TrainerState, note_load
from ort_trainer.optim import state as optim_state

from ..graph import KeyMatcher
from . import _ranks
from ._options import StateDictOptions, resolve_options

__all__ = ["load_trainer_state_dict"]

logger = logging.getLogger("ort_trainer")

_SECTIONS = frozenset(
    {
        S.MODEL_KEY,
        S.OPTIMIZER_KEY,
        S.TRAINER_OPTIONS_KEY,
        S.TRAIN_STEP_INFO_KEY,
        S.LR_SCHEDULER_KEY,
        S.LOSS_SCALER_KEY,
        S.PARTITION_INFO_KEY,
        S.DISTRIBUTED_KEY,
    }
)
_CHECKPOINT_ONLY = frozenset({S.USER_DICT_KEY, S.RANK_USER_DICTS_KEY, S.STATEFUL_KEY})  # load_checkpoint's
_WEIGHTS = f"state_dict[{S.MODEL_KEY}][{S.FULL_PRECISION_KEY}]"


def load_trainer_state_dict(
    trainer: TrainerState, state: Mapping, strict: bool = True, *, options: StateDictOptions | Any = None
) -> _IncompatibleKeys:
    """Validate ``state`` completely, then apply it; returns torch's ``_IncompatibleKeys``."""
    opts = resolve_options(options)
    strict = bool(strict) and opts.strict
    if opts.broadcast_from_rank0:
        state = _ranks.broadcast_from_rank0(trainer.store, state, check_input)
    check_input(state)
    horizontal = trainer.horizontal
    if horizontal is not None:  # Megatron: full-shaped split weights are cut to this rank's slices
        state = horizontal.localize(state, pytorch_format=_is_pytorch_format(state))
    missing, unexpected = [], []
    if _is_pytorch_format(state):
        buffers = _pytorch_buffers(trainer, state)
        state, missing, unexpected = _from_pytorch(trainer, state, strict, opts)
        plan = _validate(trainer, state, False, opts)
        plan["missing"] = [key for key in plan["missing"] if not key.startswith(f"{S.MODEL_KEY}/")]  # listed above
        plan["buffers"] = buffers
    else:
        plan = _validate(trainer, state, strict, opts)
    _apply(trainer, plan)
    return _IncompatibleKeys(missing + plan["missing"], unexpected + plan["unexpected"])


# ---------------------------------------------------------------------------- values (bad inputs named by key)
def check_input(state: Any) -> None:
    """A Mapping whose tensors all hold data: meta and sparse tensors are named by their key path."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a Mapping, got {type(state).__name__}")
    _check_values(state, "state_dict")


def _check_values(tree: Mapping, where: str) -> None:
    for key, value in tree.items():
        path = f"{where}[{key}]"
        if isinstance(value, Mapping):
            _check_values(value, path)
        elif isinstance(value, torch.Tensor):
            if value.is_meta:
                raise ValueError(f"{path} is a meta tensor (no data): materialize it before loading")
            if value.layout != torch.strided:
                raise TypeError(f"{path} is a sparse tensor ({value.layout}); pass a dense tensor (.to_dense())")


# ---------------------------------------------------------------------------- plain PyTorch dicts
def _is_pytorch_format(state: Mapping) -> bool:
    return not any(key in state for key in (S.MODEL_KEY, S.OPTIMIZER_KEY, S.TRAIN_STEP_INFO_KEY))


def _pytorch_buffers(trainer: TrainerState, state: Mapping) -> dict[str, torch.Tensor]:
    """The integer buffers of a ``{fqn: tensor}`` dict (a step counter, ``num_batches_tracked``) that the trainer
    holds (`ParamStore.buffers`), by the store's name; ValueError naming the key whose shape differs."""
    store = trainer.store
    aliases = store.state.buffer_aliases
    matched, _ = KeyMatcher(aliases).match(state.keys(), "state_dict")
    found = {}
    for key, name in matched.items():
        target = store.buffers.get(aliases[name])
        value = state[key]
        if target is None or not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"state_dict[{key!r}] has shape {list(value.shape)}, but the model's buffer has {list(target.shape)}"
            )
        found[aliases[name]] = value
    return found


def _from_pytorch(
    trainer: TrainerState, state: Mapping, strict: bool, opts: StateDictOptions
) -> tuple[dict, list[str], list[str]]:
    """``{fqn: tensor}`` (any wrapper prefixes) as our layout's model section, with missing/unexpected keys."""
    store = trainer.store
    module = store.state
    known = set(module.aliases) | set(module.initial) | set(store.extra_state)
    matched, unexpected = KeyMatcher(known).match(state.keys(), "state_dict")
    weights, extra = {}, {}
    for key, name in matched.items():
        if name in store.extra_state:
            extra[name] = state[key]
        elif module.aliases.get(name) in store.weights:
            target = module.aliases[name]
            if target not in weights or name == target:
                weights[target] = state[key]
    skip = set(store.frozen_parameters) if opts.ignore_frozen_params else set()
    missing = [
        name
        for name in module.order
        if (module.aliases.get(name) == name and name in store.weights and name not in weights and name not in skip)
        or (name in store.extra_state and name not in extra)
    ]
    if strict and (missing or unexpected):
        problems = [f"missing keys in the PyTorch state_dict: {missing}"] if missing else []
        problems += [f"unexpected keys in the PyTorch state_dict: {sorted(unexpected)}"] if unexpected else []
        raise KeyError("; ".join(problems))
    model: dict[str, Any] = {S.FULL_PRECISION_KEY: weights}
    if extra:
        model[S.EXTRA_STATE_KEY] = {name: _encoded(value) for name, value in extra.items()}
    return {S.MODEL_KEY: model}, missing, sorted(unexpected)


def _encoded(value: Any) -> Any:
    try:
        return encode_user_value(value, "extra_state")
    except TypeError:
        return value


# ---------------------------------------------------------------------------- validation (phase 1)
def _validate(trainer: TrainerState, state: Mapping, strict: bool, opts: StateDictOptions | None = None) -> dict:
    """Check everything; return what `_apply` will copy. Raises before any change.

    Meta tensors are accepted here as shape/dtype placeholders (``load_checkpoint`` validates a file
    that way before reading it into the live buffers); user input is checked by `check_input` first.
    """
    opts = opts or StateDictOptions()
    plan: dict[str, Any] = {"missing": [], "unexpected": []}
    foreign = sorted(k for k in state if k not in _SECTIONS | _CHECKPOINT_ONLY)
    if foreign and strict:
        raise KeyError(f"unexpected keys in state_dict: {foreign}")
    plan["unexpected"] += foreign
    _validate_model(trainer, state, strict, opts, plan)
    info = _validate_small_state(trainer, state, plan)
    if S.OPTIMIZER_KEY in state:
        _check_optimizer_name(trainer, state)
        optimizer = trainer.store.optimizer
        optimizer.validate_state_dict(state[S.OPTIMIZER_KEY], strict=strict)
        missing, unexpected = optimizer.incompatible_keys(state[S.OPTIMIZER_KEY], S.OPTIMIZER_KEY)
        plan["missing"] += missing
        plan["unexpected"] += unexpected
        _check_counters(trainer, state[S.OPTIMIZER_KEY], info)
        plan["optimizer"] = state[S.OPTIMIZER_KEY]
    return plan


def _validate_model(trainer: TrainerState, state: Mapping, strict: bool, opts: StateDictOptions, plan: dict) -> None:
    store = trainer.store
    if S.MODEL_KEY not in state and not strict:
        plan["weights"] = {}
        return
    model = state.get(S.MODEL_KEY, {})
    if not isinstance(model, Mapping):
        raise TypeError(f"state_dict[{S.MODEL_KEY}] must be a Mapping, got {type(model).__name__}")
    weights = model.get(S.FULL_PRECISION_KEY, {})
    if not isinstance(weights, Mapping):
        raise TypeError(f"{_WEIGHTS} must be a Mapping, got {type(weights).__name__}")
    current = store.weights
    optional = set(store.frozen_parameters) if opts.ignore_frozen_params else set()
    _check_keys(current, weights, _WEIGHTS, strict, optional, plan)
    plan["weights"] = {name: _as_tensor(weights[name], current[name], name) for name in current if name in weights}
    others = sorted(k for k in model if k not in (S.FULL_PRECISION_KEY, S.BUFFERS_KEY, S.EXTRA_STATE_KEY))
    if others and strict:
        raise KeyError(f"unexpected keys in state_dict[{S.MODEL_KEY}]: {others}")
    plan["unexpected"] += [f"{S.MODEL_KEY}/{k}" for k in others]
    if S.BUFFERS_KEY in model:  # absent in files written before it existed: the buffers keep their values
        plan["buffers"] = _validate_buffers(store, model[S.BUFFERS_KEY], strict, plan)
    if S.EXTRA_STATE_KEY in model or (strict and store.extra_state):
        extra = model.get(S.EXTRA_STATE_KEY, {})
        where = f"state_dict[{S.MODEL_KEY}][{S.EXTRA_STATE_KEY}]"
        if not isinstance(extra, Mapping):
            raise TypeError(f"{where} must be a Mapping, got {type(extra).__name__}")
        _check_keys(store.extra_state, extra, where, strict, set(), plan)
        plan["extra_state"] = {
            name: decode_user_value(value, f"{where}[{name}]", source="state_dict")
            for name, value in extra.items()
            if name in store.extra_state
        }


def _validate_buffers(store: Any, loaded: Any, strict: bool, plan: dict) -> dict[str, torch.Tensor]:
    """``model/buffers``: each a tensor of the shape and dtype of the model's buffer (meta placeholders accepted, as
    for the weights); a mismatch is a ValueError naming the key, raised before anything is applied."""
    where = f"state_dict[{S.MODEL_KEY}][{S.BUFFERS_KEY}]"
    if not isinstance(loaded, Mapping):
        raise TypeError(f"{where} must be a Mapping, got {type(loaded).__name__}")
    current = store.persistent_buffers
    _check_keys(current, loaded, where, strict, set(), plan)
    found = {}
    for name, target in current.items():
        if name not in loaded:
            continue
        value = loaded[name]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}[{name}] must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"shape mismatch for {where}[{name}]: the state has {tuple(value.shape)}, "
                f"the model's buffer has {tuple(target.shape)}"
            )
        if value.dtype != target.dtype:  # an integer counter is never cast silently (nor a float one truncated)
            raise ValueError(
                f"dtype mismatch for {where}[{name}]: the state has {value.dtype}, the model's buffer is {target.dtype}"
            )
        found[name] = value
    return found


def _check_keys(current: Mapping, loaded: Mapping, where: str, strict: bool, optional: set, plan: dict) -> None:
    missing = sorted(set(current) - set(loaded) - optional)
    unexpected = sorted(set(loaded) - set(current))
    problems = []
    if missing and strict:
        problems.append(f"missing keys in {where}: {missing}")
    if unexpected and strict:
        problems.append(f"unexpected keys in {where}: {unexpected}")
    if problems:
        raise KeyError("; ".join(problems))
    path = where.removeprefix("state_dict[").removesuffix("]").replace("][", "/")
    plan["missing"] += [f"{path}/{k}" for k in missing]
    plan["unexpected"] += [f"{path}/{k}" for k in unexpected]


def _validate_small_state(trainer: TrainerState, state: Mapping, plan: dict) -> Any:
    """train_step_info, lr_scheduler, loss_scaler: each loaded into a copy first. Returns the step info to be."""
    info = trainer.train_step_info
    if S.TRAIN_STEP_INFO_KEY in state:
        info = copy.deepcopy(trainer.train_step_info)
        info.load_state_dict(state[S.TRAIN_STEP_INFO_KEY])
        plan["train_step_info"] = state[S.TRAIN_STEP_INFO_KEY]
    scheduler = trainer.options.lr_scheduler
    if S.LR_SCHEDULER_KEY in state and scheduler is not None:
        copy.deepcopy(scheduler).load_state_dict(state[S.LR_SCHEDULER_KEY])
        plan["lr_scheduler"] = state[S.LR_SCHEDULER_KEY]
    scaler = trainer.options.mixed_precision.loss_scaler
    if S.LOSS_SCALER_KEY in state and scaler is not None:
        copy.deepcopy(scaler).load_state_dict(state[S.LOSS_SCALER_KEY])
        plan["loss_scaler"] = state[S.LOSS_SCALER_KEY]
    return info


def _check_counters(trainer: TrainerState, optimizer: Mapping, info: Any) -> None:
    """Every Update_Count (LAMB: Step) must be optimization_step + 1: it sets Adam's bias correction."""
    expected = optim_state.update_count_for(info.optimization_step)
    because = f"train_step_info.optimization_step is {info.optimization_step}"
    wrong = optim_state.counter_mismatches(
        trainer.optim_config.name, optimizer, expected, "state_dict[optimizer]", because
    )
    if wrong:
        raise ValueError(
            "optimizer counters disagree with the step count (Adam's bias correction depends on them):\n  "
            + "\n  ".join(wrong)
        )


def _check_optimizer_name(trainer: TrainerState, state: Mapping) -> None:
    options = state.get(S.TRAINER_OPTIONS_KEY)
    if not isinstance(options, Mapping) or S.OPTIMIZER_NAME_KEY not in options:
        return
    name = options[S.OPTIMIZER_NAME_KEY]
    name = name.decode() if isinstance(name, bytes) else str(name)
    if name != trainer.optim_config.name:
        raise ValueError(
            f"optimizer mismatch: the state was saved with {name!r} but this trainer uses "
            f"{trainer.optim_config.name!r}; load with a matching optim_config or drop the optimizer state"
        )


def _as_tensor(value: Any, target: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{_WEIGHTS}[{name}] must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"shape mismatch for {_WEIGHTS}[{name}]: checkpoint has {tuple(value.shape)}, "
            f"model has {tuple(target.shape)}"
        )
    if not value.is_floating_point():
        raise TypeError(f"{_WEIGHTS}[{name}] must be floating point, got {value.dtype}")
    if value.dtype != target.dtype:  # weights load in the model's own dtype, never cast silently
        raise TypeError(
            f"{_WEIGHTS}[{name}] has dtype {value.dtype}, but the model's weight is {target.dtype}; "
            f"convert it first (e.g. value.to({target.dtype}))"
        )
    return value


# ---------------------------------------------------------------------------- apply (phase 2)
def _apply(trainer: TrainerState, plan: Mapping[str, Any]) -> None:
    """Copy a validated plan into the live state (nothing here can fail on a validated plan)."""
    store = trainer.store
    current = store.weights
    with torch.no_grad():
        for name, value in plan["weights"].items():
            current[name].copy_(value)
        for name, value in plan.get("buffers", {}).items():
            store.buffers[name].copy_(value)
    store.extra_state.update(plan.get("extra_state", {}))
    if "optimizer" in plan:
        store.optimizer.load_state_dict(plan["optimizer"], strict=False)
    if "train_step_info" in plan:
        trainer.train_step_info.load_state_dict(plan["train_step_info"])
        _start_mid_window(trainer)
    store.optimizer.set_update_count(optim_state.update_count_for(trainer.train_step_info.optimization_step))
    if "lr_scheduler" in plan:
        trainer.options.lr_scheduler.load_state_dict(plan["lr_scheduler"])
    if "loss_scaler" in plan:
        trainer.options.mixed_precision.loss_scaler.load_state_dict(plan["loss_scaler"])
    note_load(store)


def _start_mid_window(trainer: TrainerState) -> None:
    """A state loaded at a step inside a gradient accumulation window (saved by an older version, or through
    ``state_dict()``): the gradient of the window's earlier micro-steps is not in it. The buffer is emptied,
    so that the window's update uses only the micro-steps after the load, whatever the buffer held (it is
    reset only at a window's first micro-step); and the user is told."""
    accumulation = trainer.options.batch.gradient_accumulation_steps
    step = trainer.train_step_info.step
    done = step % accumulation
    if not done:
        return
    trainer.store.padded_grads.zero_()
    logger.warning(
        "loaded a state saved at step %d, inside a gradient accumulation window (gradient_accumulation_steps=%d: "
        "%d micro-step(s) of it done): their gradient was not saved, so the update at step %d uses only the "
        "micro-steps after this load and differs from the original run's",
        step,
        accumulation,
        done,
        step - done + accumulation,
    )
