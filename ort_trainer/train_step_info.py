"""``TrainStepInfo``: the step counters the trainer hands to LR schedulers and loss scalers.

``step`` counts ``train_step`` calls (micro-steps); ``optimization_step`` counts completed
optimizer updates (it lags ``step`` under gradient accumulation and skips overflowed fp16 steps).
The two counters are state (``state_dict()``), and ``seed`` when set: the run's random seed, from which
the trainer derives every step's Dropout masks (so that a resumed run draws the masks the uninterrupted
run drew). The rest describes the current step.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["TrainStepInfo"]

_STATE_KEYS = ("optimization_step", "step")
_SEED_KEY = "seed"  # optional: absent in files written before it existed (and by the legacy ORTTrainer)


def _as_int(name: str, value: Any) -> int:
    """Return ``value`` as an int >= 0; 0-d numpy/torch integers are accepted, bools are not."""
    if not isinstance(value, bool | int) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"'{name}' must be an int >= 0, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_optimizer_config(value: Any) -> Any:
    """Accept an ``optim.config.OptimizerConfig`` (imported here: optim is a leaf, but ``import ort_trainer``
    stays light)."""
    from ort_trainer.optim.config import OptimizerConfig

    if not isinstance(value, OptimizerConfig):
        raise TypeError(f"'optimizer_config' must be an optim.config._OptimizerConfig, got {type(value).__name__}")
    return value


class TrainStepInfo:
    """Per-step information for schedulers and loss scalers; every attribute is validated on assignment.

    Attributes: ``optimizer_config``, ``all_finite`` (bool, False when the fp16 step overflowed),
    ``fetches`` (list of output names the user asked for), ``optimization_step``, ``step``, ``seed``
    (the run's random seed, an int >= 0, or None where no trainer set one).
    """

    def __init__(
        self,
        optimizer_config: Any,
        all_finite: bool = True,
        fetches: list[str] | None = None,
        optimization_step: int = 0,
        step: int = 0,
        seed: int | None = None,
    ) -> None:
        self.optimizer_config = optimizer_config
        self.seed = seed
        self.all_finite = all_finite
        self.fetches = [] if fetches is None else fetches
        self.optimization_step = optimization_step
        self.step = step

    @property
    def optimizer_config(self) -> Any:
        """The optimizer configuration (gives schedulers their base ``lr``)."""
        return self._optimizer_config

    @optimizer_config.setter
    def optimizer_config(self, value: Any) -> None:
        self._optimizer_config = _check_optimizer_config(value)

    @property
    def all_finite(self) -> bool:
        """Whether every gradient of the last step was finite."""
        return self._all_finite

    @all_finite.setter
    def all_finite(self, value: bool) -> None:
        if not isinstance(value, bool) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            value = value.item()  # numpy / torch 0-d booleans read back from a session
        if not isinstance(value, bool):
            raise TypeError(f"'all_finite' must be a bool, got {value!r} ({type(value).__name__})")
        self._all_finite = value

    @property
    def fetches(self) -> list[str]:
        """Output names to fetch instead of the defaults (a private copy of what was assigned)."""
        return self._fetches

    @fetches.setter
    def fetches(self, value: list[str]) -> None:
        if not isinstance(value, list | tuple):
            raise TypeError(f"'fetches' must be a list of str, got {type(value).__name__}")
        bad = [f"[{i}]={item!r}" for i, item in enumerate(value) if not isinstance(item, str)]
        if bad:
            raise TypeError(f"'fetches' must be a list of str; non-str entries: {', '.join(bad)}")
        self._fetches = list(value)

    @property
    def optimization_step(self) -> int:
        """Number of completed optimizer updates."""
        return self._optimization_step

    @optimization_step.setter
    def optimization_step(self, value: int) -> None:
        self._optimization_step = _as_int("optimization_step", value)

    @property
    def step(self) -> int:
        """Number of ``train_step`` calls so far."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = _as_int("step", value)

    @property
    def seed(self) -> int | None:
        """The run's random seed (Dropout masks of step n come from it, the rank and n); None if not set."""
        return self._seed

    @seed.setter
    def seed(self, value: int | None) -> None:
        self._seed = None if value is None else _as_int("seed", value)

    def state_dict(self) -> dict[str, int]:
        """The counters: ``{"optimization_step": int, "step": int}``, plus ``"seed"`` when it is set."""
        state = {"optimization_step": self._optimization_step, "step": self._step}
        if self._seed is not None:
            state[_SEED_KEY] = self._seed
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate both counters (exact keys, ints >= 0) and the optional seed, then assign; a failure changes
        nothing. Without ``"seed"`` (older files) the current seed stays."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"TrainStepInfo state_dict must be a dict, got {type(state_dict).__name__}")
        missing = sorted(set(_STATE_KEYS) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(_STATE_KEYS) - {_SEED_KEY}, key=str)
        if missing or unexpected:
            raise ValueError(
                f"TrainStepInfo state_dict keys do not match: missing {missing}, unexpected {unexpected}; "
                f"expected exactly {list(_STATE_KEYS)} (and optionally {_SEED_KEY!r})"
            )
        values = {key: _as_int(key, state_dict[key]) for key in _STATE_KEYS}
        seed = _as_int(_SEED_KEY, state_dict[_SEED_KEY]) if _SEED_KEY in state_dict else self._seed
        self._optimization_step, self._step, self._seed = values["optimization_step"], values["step"], seed

    def __repr__(self) -> str:
        return (
            f"TrainStepInfo(optimizer_config={self._optimizer_config!r}, all_finite={self._all_finite}, "
            f"fetches={self._fetches!r}, optimization_step={self._optimization_step}, step={self._step}, "
            f"seed={self._seed})"
        )
