"""Optimizer state in ``torch.optim``'s format, both ways, for the configs torch can express.

``AdamConfig`` in decay mode 0 with bias correction *is* ``torch.optim.AdamW`` and ``SGDConfig`` is
``torch.optim.SGD`` without momentum; their state converts exactly:

    {"state": {fqn: {"step": tensor(float), "exp_avg": m, "exp_avg_sq": v}},
     "param_groups": [{"lr", "betas", "eps", "weight_decay", ..., "params": [fqn, ...]}, ...]}

which is what ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, AdamW(...))``
returns (fqn keys; ``Optimizer.state_dict()`` has int keys instead, which the caller maps to names).
The step counters are related in one place, `optim.state.torch_step_for` / `update_count_for`.
Everything torch cannot express (LAMB, Adam's legacy decay mode 1, no bias correction, SGD with
momentum, AMSGrad, ...) raises ValueError naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import state as _state
from .config import DecayMode, _OptimizerConfig

__all__ = ["check_torch_expressible", "from_torch_state", "to_torch_state"]

_ADAMW_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
_SGD_FLAGS = {
    "momentum": 0,
    "dampening": 0,
    "weight_decay": 0,
    "nesterov": False,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}
_ADAM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def check_torch_expressible(config: _OptimizerConfig) -> None:
    """ValueError naming the first option ``torch.optim.AdamW`` / ``SGD`` cannot express."""
    if config.name == "LambOptimizer":
        raise ValueError(
            "LambOptimizer (LAMB) has no torch.optim counterpart: its state cannot be exchanged in torch's format "
            "(use state_dict()['optimizer'] instead)"
        )
    if config.name != "AdamOptimizer":
        return
    for where, hp in _groups_with_defaults(config):
        if hp["weight_decay_mode"] != DecayMode.BEFORE_WEIGHT_UPDATE:
            raise ValueError(
                f"AdamConfig {where}weight_decay_mode={DecayMode(hp['weight_decay_mode']).name} (the legacy Hugging "
                "Face AdamW rule) has no torch.optim counterpart; torch.optim.AdamW is "
                "weight_decay_mode=DecayMode.BEFORE_WEIGHT_UPDATE"
            )
        if not hp["do_bias_correction"]:
            raise ValueError(
                f"AdamConfig {where}do_bias_correction=False has no torch.optim counterpart (torch.optim.AdamW "
                "always corrects the bias)"
            )


def _groups_with_defaults(config: _OptimizerConfig) -> list[tuple[str, Mapping[str, Any]]]:
    return [("", config.defaults)] + [(f"params[{i}]: ", g) for i, g in enumerate(config.params)]


def _torch_hyper_parameters(config: _OptimizerConfig, hp: Mapping[str, Any], lr: float) -> dict[str, Any]:
    if config.name == "SGDOptimizer":
        return {"lr": lr, **_SGD_FLAGS}
    return {
        "lr": lr,
        "betas": (hp["alpha"], hp["beta"]),
        "eps": hp["epsilon"],
        "weight_decay": hp["lambda"],
        **_ADAMW_FLAGS,
    }


def to_torch_state(config: _OptimizerConfig, names: Sequence[str], legacy: Mapping[str, Any], lr: float) -> dict:
    """torch's ``{"state", "param_groups"}`` for parameters ``names`` (layout order) from our state."""
    check_torch_expressible(config)
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(config.group_index(name), []).append(name)
    param_groups = []
    for index in sorted(groups):
        hp = config.params[index] if index < len(config.params) else config.defaults
        param_groups.append({**_torch_hyper_parameters(config, hp, lr), "params": list(groups[index])})
    state = {}
    if config.name == "AdamOptimizer":
        for group in param_groups:
            for name in group["params"]:
                entry = legacy[name]
                step = _state.torch_step_for(_state.counter_value(entry[_state.UPDATE_COUNT]))
                state[name] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": _state.as_tensor(entry["Moment_1"]).clone(),
                    "exp_avg_sq": _state.as_tensor(entry["Moment_2"]).clone(),
                }
    return {"state": state, "param_groups": param_groups}


def from_torch_state(
    config: _OptimizerConfig, shapes: Mapping[str, tuple[int, ...]], osd: Mapping[str, Any], *, strict: bool
) -> tuple[dict[str, Any], int | None, list[str], list[str]]:
    """Our optimizer state from torch's, whose keys are already our parameter names.

    Returns ``(state, updates, missing, unexpected)``: ``updates`` is the common torch ``step`` (None when
    there is no per-parameter state, e.g. SGD). Raises ValueError for hyper-parameters this config does
    not have, differing steps, bad shapes; KeyError for missing/unexpected parameters when ``strict``.
    """
    check_torch_expressible(config)
    _check_param_groups(config, osd.get("param_groups"), shapes)
    entries = osd.get("state")
    if not isinstance(entries, Mapping):
        raise TypeError(f"optimizer_state_dict['state'] must be a dict, got {type(entries).__name__}")
    if config.name == "SGDOptimizer":
        if entries:
            raise ValueError(
                f"optimizer_state_dict['state'] has entries for {sorted(entries)[:5]}: torch.optim.SGD keeps state "
                "only with momentum, which SGDConfig does not have"
            )
        return {}, None, [], []
    missing = [n for n in shapes if n not in entries]
    unexpected = [n for n in entries if n not in shapes]
    if strict and (missing or unexpected):
        raise KeyError(
            f"optimizer_state_dict['state']: missing parameters {missing}; unexpected parameters {unexpected}"
        )
    steps = {name: _entry_step(name, entries[name], shapes[name]) for name in shapes if name in entries}
    updates = _common_step(steps)
    state = {
        name: {
            "Moment_1": entries[name]["exp_avg"],
            "Moment_2": entries[name]["exp_avg_sq"],
            _state.UPDATE_COUNT: torch.tensor([_state.update_count_for(updates)], dtype=torch.int64),
        }
        for name in steps
    }
    return state, updates, missing, unexpected


def _entry_step(name: str, entry: Any, shape: tuple[int, ...]) -> int:
    where = f"optimizer_state_dict['state'][{name}]"
    if not isinstance(entry, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(entry).__name__}")
    extra = sorted(set(entry) - set(_ADAM_STATE_KEYS))
    if extra:
        hint = " (AMSGrad: set amsgrad=False)" if "max_exp_avg_sq" in extra else ""
        raise ValueError(f"{where} has keys {extra} that AdamW without amsgrad does not have{hint}")
    lacking = [k for k in _ADAM_STATE_KEYS if k not in entry]
    if lacking:
        raise KeyError(f"{where} lacks {lacking}")
    for key in ("exp_avg", "exp_avg_sq"):
        value = entry[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"state[{name}][{key}] must be a floating-point tensor, got {_describe(value)}")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"state[{name}][{key}]: shape mismatch: expected {tuple(shape)}, got {tuple(value.shape)}")
    step = entry["step"]
    step = float(step.item()) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if isinstance(step, bool) or not isinstance(step, int | float) or step != int(step) or step < 0:
        raise ValueError(f"state[{name}][step] must be a whole number >= 0, got {entry['step']!r}")
    return int(step)


def _common_step(steps: Mapping[str, int]) -> int:
    if not steps:
        return 0
    values = sorted(set(steps.values()), key=lambda s: -list(steps.values()).count(s))
    if len(values) > 1:
        common = values[0]
        odd = sorted(n for n, s in steps.items() if s != common)
        raise ValueError(
            f"state[{odd[0]}][step] is {steps[odd[0]]}, but the other parameters are at step {common} "
            f"({len(odd)} parameter(s) differ: {odd}); ORTTrainer updates every trainable parameter at every step"
        )
    return values[0]


def _check_param_groups(config: _OptimizerConfig, groups: Any, shapes: Mapping[str, Any]) -> None:
    """Every torch group's hyper-parameters must be what this config uses for the group's parameters."""
    if not isinstance(groups, Sequence) or isinstance(groups, str):
        raise TypeError(f"optimizer_state_dict['param_groups'] must be a list, got {type(groups).__name__}")
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise TypeError(f"optimizer_state_dict['param_groups'][{i}] must be a dict, got {type(group).__name__}")
        names = [n for n in group.get("params", []) if n in shapes] or [None]
        for name in names:
            hp = config.hyper_parameters(name) if name is not None else config.defaults
            _check_group(config, i, group, _torch_hyper_parameters(config, hp, config.lr), name)


def _check_group(config: _OptimizerConfig, i: int, group: Mapping[str, Any], expected: dict, name: str | None) -> None:
    for key, value in group.items():
        if key in ("params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"):
            continue
        if key == "decoupled_weight_decay" and not value and not group.get("weight_decay"):
            continue  # torch.optim.Adam without weight decay is AdamW
        want = expected.get(key, "<absent>")
        if not _same(value, want):
            owner = name if name is not None else "the defaults"
            raise ValueError(
                f"optimizer_state_dict['param_groups'][{i}][{key!r}] is {value!r}, but this trainer's "
                f"{type(config).__name__} has {want!r} for {owner} ({_meaning(key)})"
            )


def _same(value: Any, want: Any) -> bool:
    if isinstance(want, tuple):
        return isinstance(value, Sequence) and len(value) == len(want) and all(map(_same, value, want))
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return value == want
    return isinstance(value, int | float) and not isinstance(value, bool) and float(value) == float(want)


def _meaning(key: str) -> str:
    return {
        "betas": "AdamConfig(alpha, beta)",
        "eps": "AdamConfig(epsilon)",
        "weight_decay": "lambda_coef",
        "momentum": "SGDConfig has no momentum",
        "amsgrad": "AMSGrad is not supported",
        "decoupled_weight_decay": "torch.optim.Adam's L2 weight decay is not AdamW's; AdamConfig is AdamW",
        "<absent>": "",
    }.get(key, "not supported")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return type(value).__name__
