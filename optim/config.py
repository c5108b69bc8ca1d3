"""Optimizer configurations: what to optimize with, not the optimizer itself.

`AdamConfig`, `LambConfig` and `SGDConfig` keep the legacy ORTTrainer constructor names, defaults and
attributes (`name`, `lr`, `defaults`, `params`), so legacy scripts keep working. Unlike the legacy
code they validate with `ValueError`/`TypeError` (never `assert`), never mutate the caller's
parameter groups and have no mutable default arguments. The update rules live in
`optim._flat_optimizer`; the trainer asks a config for per-parameter hyper-parameters and for
the group of each parameter (`hyper_parameters`, `group_index`, `check_param_names`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum, unique
from types import MappingProxyType
from typing import Any

__all__ = ["AdamConfig", "DecayMode", "LambConfig", "OptimizerConfig", "SGDConfig"]

_OPTIMIZER_NAMES = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")


@unique
class DecayMode(IntEnum):
    """Where Adam applies weight decay: 0 like `torch.optim.AdamW`, 1 like HuggingFace's AdamW."""

    BEFORE_WEIGHT_UPDATE = 0
    AFTER_WEIGHT_UPDATE = 1


# ---------------------------------------------------------------- field validators
def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"'{field}' must be a number, got {value!r} ({type(value).__name__})")
    if math.isnan(value):
        raise ValueError(f"'{field}' must not be NaN")
    return float(value)


def _non_negative(field: str, value: Any) -> float:
    out = _number(field, value)
    if not (0.0 <= out < math.inf):
        raise ValueError(f"'{field}' must be a finite number >= 0, got {value!r}")
    return out


def _decay_rate(field: str, value: Any) -> float:
    out = _number(field, value)
    if not 0.0 <= out < 1.0:
        raise ValueError(f"'{field}' must be in [0, 1) (it is a moving-average decay rate), got {value!r}")
    return out


def _clip_norm(field: str, value: Any) -> float:
    out = _number(field, value)
    if not out > 0.0:
        raise ValueError(
            f"'{field}' must be a positive number (the global gradient-norm threshold; "
            f"use float('inf') to never clip), got {value!r}"
        )
    return out


def _ratio(field: str, value: Any) -> float:
    return _number(field, value)


def _boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"'{field}' must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _decay_mode(field: str, value: Any) -> DecayMode:
    if isinstance(value, DecayMode):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value in set(DecayMode):
        return DecayMode(value)
    valid = ", ".join(f"DecayMode.{m.name}" for m in DecayMode)
    raise ValueError(f"'{field}' must be one of {valid}, got {value!r}")


class _Default(float):
    """A keyword's default number, told apart from the same number given by the caller: ``alpha=0.9`` and
    ``betas=(...)`` together are two spellings of one hyper-parameter, refused; the default alone is not."""


# what the hyper-parameters are called in messages (the stored 'lambda' is the keyword 'lambda_coef')
_KEYWORD = {"lambda": "lambda_coef"}


# --------------------------------------------------------------------- base class
class OptimizerConfig:
    """Base of the optimizer configurations (legacy `optim.OptimizerConfig`).

    Args:
        name: 'AdamOptimizer', 'LambOptimizer' or 'SGDOptimizer'.
        params: parameter groups, e.g. ``[{"params": ["fc1.weight"], "alpha": 0.8}]``. Each group
            overrides hyper-parameters of `defaults` (except 'lr') for the named parameters; a
            parameter uses the first group that names it, or `defaults` if none does.
        defaults: hyper-parameters of every parameter; must contain 'lr'.

    Attributes: `name`, `lr` (float), `defaults` (dict), `params` (list of group dicts, each a new
    dict filled with every default; 'lambda_coef' is stored as 'lambda' as the backend expects).
    """

    # field name -> validator; subclasses extend it. 'lambda' is the stored name of 'lambda_coef'.
    _VALIDATORS: Mapping[str, Any] = MappingProxyType({"lr": _non_negative})
    # PyTorch's keywords (torch.optim.AdamW's) -> the stored names they set; 'betas' is the pair (alpha, beta)
    _TORCH_NAMES: Mapping[str, tuple[str, ...]] = MappingProxyType({})

    def __init__(self, name: str, params: Sequence[Mapping[str, Any]] | None, defaults: Mapping[str, Any]):
        if not isinstance(name, str) or name not in _OPTIMIZER_NAMES:
            raise ValueError(f"'name' must be one of {', '.join(_OPTIMIZER_NAMES)}, got {name!r}")
        if not isinstance(defaults, Mapping) or "lr" not in defaults:
            raise ValueError(f"'defaults' must be a dict with an 'lr' entry, got {defaults!r}")
        self.name = name
        owner = f"{type(self).__name__}: "
        self.defaults = {k: self._validate(k, v, where=owner) for k, v in defaults.items()}
        self.lr = float(self.defaults["lr"])
        self.params: list[dict[str, Any]] = []
        for index, group in enumerate(self._check_groups(params)):
            self._add_param_group(index, group)

    # -- construction helpers
    def _validate(self, key: str, value: Any, where: str, field: str | None = None) -> Any:
        validator = self._VALIDATORS.get(key)
        if validator is None:
            also = f" (or PyTorch's {', '.join(sorted(self._TORCH_NAMES))})" if self._TORCH_NAMES else ""
            raise ValueError(
                f"{where}unknown hyper-parameter {key!r}; valid: {', '.join(sorted(self._VALIDATORS))}{also}"
            )
        try:
            return validator(field or _KEYWORD.get(key, key), value)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}{err}") from None

    def _torch_spelled(self, torch_name: str, value: Any, where: str) -> dict[str, Any]:
        """{stored name: validated value} for a hyper-parameter given by its PyTorch name (errors name that)."""
        keys = self._TORCH_NAMES[torch_name]
        if len(keys) == 1:
            return {keys[0]: self._validate(keys[0], value, where, field=torch_name)}
        if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != len(keys):
            raise TypeError(f"{where}{torch_name!r} must be a pair (beta1, beta2) of numbers, got {value!r}")
        pairs = enumerate(zip(keys, value, strict=True))
        return {k: self._validate(k, v, where, field=f"{torch_name}[{i}]") for i, (k, v) in pairs}

    def _with_torch_names(self, defaults: dict[str, Any], **spelled: Any) -> dict[str, Any]:
        """``defaults`` with the hyper-parameters given by PyTorch's names (None: not given) put in; giving one
        also by our name (any value that is not the `_Default`, even the same number) is refused."""
        where = f"{type(self).__name__}: "
        merged = dict(defaults)
        for torch_name, value in spelled.items():
            if value is None:
                continue
            converted = self._torch_spelled(torch_name, value, where)
            both = [repr(_KEYWORD.get(k, k)) for k in converted if not isinstance(defaults[k], _Default)]
            if both:
                raise TypeError(
                    f"{where}got both {torch_name!r} (PyTorch's name) and {', '.join(both)}: give one of them"
                )
            merged.update(converted)
        return merged

    @staticmethod
    def _check_groups(params: Any) -> list[Mapping[str, Any]]:
        if params is None:
            return []
        if isinstance(params, str | bytes | Mapping) or not isinstance(params, Sequence):
            raise TypeError(f"'params' must be a list of parameter-group dicts, got {type(params).__name__}")
        return list(params)

    def _add_param_group(self, index: int, group: Mapping[str, Any]) -> None:
        where = f"{type(self).__name__}: params[{index}]: "
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"{where}each parameter group must be a dict with a 'params' list of parameter names")
        names = group["params"]
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(f"{where}'params' must be a list of parameter names, got {names!r}")
        names = list(names)
        bad = sorted(repr(n) for n in names if not isinstance(n, str))
        if bad:
            raise TypeError(f"{where}parameter names must be strings, got {', '.join(bad)}")
        overrides = {k: v for k, v in group.items() if k != "params"}
        if "lr" in overrides:
            raise ValueError(
                f"{where}per-group 'lr' is not supported: ONNX Runtime trains with one learning rate; "
                "set lr on the config (or use an LR scheduler) and remove 'lr' from the group"
            )
        if "lambda_coef" in overrides:
            if "lambda" in overrides:
                raise ValueError(f"{where}give either 'lambda_coef' or 'lambda', not both")
            overrides["lambda"] = overrides.pop("lambda_coef")
        for torch_name in [k for k in overrides if k in self._TORCH_NAMES]:
            converted = self._torch_spelled(torch_name, overrides.pop(torch_name), where)
            both = [repr(_KEYWORD.get(k, k)) for k in converted if k in overrides]
            if both:
                raise ValueError(f"{where}give either {torch_name!r} (PyTorch's name) or {', '.join(both)}, not both")
            overrides.update(converted)
        if not overrides:
            raise ValueError(f"{where}a parameter group needs at least one hyper-parameter besides 'params'")
        filled = {"params": names, **self.defaults}
        for key, value in overrides.items():
            filled[key] = self._validate(key, value, where)
        self.params.append(filled)

    # -- queries used by the trainer
    def group_index(self, name: str) -> int:
        """Index of the first group naming parameter `name`; `len(self.params)` means 'defaults'."""
        for index, group in enumerate(self.params):
            if name in group["params"]:
                return index
        return len(self.params)

    def hyper_parameters(self, name: str) -> dict[str, Any]:
        """Hyper-parameters (all but 'params' and 'lr') that apply to parameter `name`."""
        index = self.group_index(name)
        source = self.params[index] if index < len(self.params) else self.defaults
        return {k: v for k, v in source.items() if k not in ("params", "lr")}

    def check_param_names(self, trainable_names: Iterable[str]) -> None:
        """Raise ValueError listing every group entry that is not a trainable parameter name."""
        known = set(trainable_names)
        unknown = sorted(
            {f"params[{i}]: {n!r}" for i, g in enumerate(self.params) for n in g["params"] if n not in known}
        )
        if unknown:
            raise ValueError(
                f"{self.name} parameter groups name {len(unknown)} parameter(s) that are not trainable "
                f"parameters of the model: {'; '.join(unknown)}. Check the spelling (names are the model's "
                "state_dict keys) and that they are not frozen."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(params={self.params!r}, defaults={self.defaults!r})"


# ----------------------------------------------------------------- the configs
class SGDConfig(OptimizerConfig):
    """Plain SGD, w -= lr * g. No parameter groups: `params` must be empty.

    `momentum` and `weight_decay` (torch.optim.SGD's keywords) are accepted at 0 only, which is this update;
    anything else is refused with a ValueError rather than silently ignored.
    """

    def __init__(
        self,
        params: Sequence[Mapping[str, Any]] | None = None,
        lr: float = 0.001,
        *,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ):
        if params:
            raise ValueError(
                f"'params' must be an empty list for SGD optimizer (SGD has no per-group hyper-parameters), "
                f"got {len(params)} group(s)"
            )
        super().__init__(name="SGDOptimizer", params=None, defaults={"lr": lr})
        torch_only = {"momentum": momentum, "weight_decay": weight_decay}
        for key, value in torch_only.items():
            self._validate("lr", value, "SGDConfig: ", field=key)  # a number >= 0, as lr
        given = [f"{key}={value!r}" for key, value in torch_only.items() if value != 0]
        if given:
            raise ValueError(
                f"SGDConfig: {', '.join(given)} {'is' if len(given) == 1 else 'are'} not supported: this SGD is "
                "plain w -= lr * g (the legacy SGDOptimizer: no momentum, no weight decay). Use AdamConfig "
                "(weight_decay=..., betas=...) for those, or leave them at 0"
            )


class AdamConfig(OptimizerConfig):
    """Adam with the legacy backend semantics (see `optim._flat_optimizer`).

    Args: params (parameter groups), lr, alpha (beta1), beta (beta2), lambda_coef (weight decay),
    epsilon, max_norm_clip (global gradient-norm clip threshold), do_bias_correction,
    weight_decay_mode (`DecayMode`; BEFORE_WEIGHT_UPDATE equals `torch.optim.AdamW`).

    PyTorch's names work too, keyword-only, here and in parameter groups: ``betas=(alpha, beta)``,
    ``eps`` (epsilon), ``weight_decay`` (lambda_coef: decoupled, as torch.optim.AdamW's, not torch.optim.Adam's
    L2 term; the default stays 0, not AdamW's 0.01). Giving one hyper-parameter by both names is refused.
    """

    DecayMode = DecayMode  # legacy spelling: AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE

    _VALIDATORS = MappingProxyType(
        {
            "lr": _non_negative,
            "alpha": _decay_rate,
            "beta": _decay_rate,
            "lambda": _non_negative,
            "epsilon": _non_negative,
            "max_norm_clip": _clip_norm,
            "do_bias_correction": _boolean,
            "weight_decay_mode": _decay_mode,
        }
    )
    _TORCH_NAMES = MappingProxyType({"betas": ("alpha", "beta"), "eps": ("epsilon",), "weight_decay": ("lambda",)})

    def __init__(
        self,
        params: Sequence[Mapping[str, Any]] | None = None,
        lr: float = 0.001,
        alpha: float = _Default(0.9),
        beta: float = _Default(0.999),
        lambda_coef: float = _Default(0.0),
        epsilon: float = _Default(1e-8),
        max_norm_clip: float = 1.0,
        do_bias_correction: bool = True,
        weight_decay_mode: DecayMode = DecayMode.BEFORE_WEIGHT_UPDATE,
        *,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
    ):
        defaults = {
            "lr": lr,
            "alpha": alpha,
            "beta": beta,
            "lambda": lambda_coef,
            "epsilon": epsilon,
            "max_norm_clip": max_norm_clip,
            "do_bias_correction": do_bias_correction,
            "weight_decay_mode": weight_decay_mode,
        }
        defaults = self._with_torch_names(defaults, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(name="AdamOptimizer", params=params, defaults=defaults)
        d = self.defaults
        self.alpha, self.beta, self.lambda_coef, self.epsilon = d["alpha"], d["beta"], d["lambda"], d["epsilon"]
        self.max_norm_clip, self.do_bias_correction = d["max_norm_clip"], d["do_bias_correction"]
        self.weight_decay_mode = d["weight_decay_mode"]


class LambConfig(OptimizerConfig):
    """LAMB with the legacy backend semantics (see `optim._flat_optimizer`).

    Args: params (parameter groups), lr, alpha (beta1), beta (beta2), lambda_coef (weight decay),
    ratio_min / ratio_max (trust-ratio clamp), epsilon, max_norm_clip, do_bias_correction.
    PyTorch's ``betas``, ``eps`` and ``weight_decay`` work as in `AdamConfig`.
    """

    _VALIDATORS = MappingProxyType(
        {
            "lr": _non_negative,
            "alpha": _decay_rate,
            "beta": _decay_rate,
            "lambda": _non_negative,
            "ratio_min": _ratio,
            "ratio_max": _ratio,
            "epsilon": _non_negative,
            "max_norm_clip": _clip_norm,
            "do_bias_correction": _boolean,
        }
    )
    _TORCH_NAMES = AdamConfig._TORCH_NAMES

    def __init__(
        self,
        params: Sequence[Mapping[str, Any]] | None = None,
        lr: float = 0.001,
        alpha: float = _Default(0.9),
        beta: float = _Default(0.999),
        lambda_coef: float = _Default(0.0),
        ratio_min: float = float("-inf"),
        ratio_max: float = float("inf"),
        epsilon: float = _Default(1e-6),
        max_norm_clip: float = 1.0,
        do_bias_correction: bool = False,
        *,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
    ):
        defaults = {
            "lr": lr,
            "alpha": alpha,
            "beta": beta,
            "lambda": lambda_coef,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "epsilon": epsilon,
            "max_norm_clip": max_norm_clip,
            "do_bias_correction": do_bias_correction,
        }
        defaults = self._with_torch_names(defaults, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(name="LambOptimizer", params=params, defaults=defaults)
        groups = [("", self.defaults)] + [(f"params[{i}]: ", g) for i, g in enumerate(self.params)]
        for where, group in groups:
            if group["ratio_min"] > group["ratio_max"]:
                raise ValueError(
                    f"LambConfig: {where}'ratio_min' ({group['ratio_min']}) must not exceed "
                    f"'ratio_max' ({group['ratio_max']})"
                )
        d = self.defaults
        self.alpha, self.beta, self.lambda_coef, self.epsilon = d["alpha"], d["beta"], d["lambda"], d["epsilon"]
        self.ratio_min, self.ratio_max = d["ratio_min"], d["ratio_max"]
        self.max_norm_clip, self.do_bias_correction = d["max_norm_clip"], d["do_bias_correction"]


# The legacy ORTTrainer spelled the base class `_OptimizerConfig`; the old name keeps working.
_OptimizerConfig = OptimizerConfig
