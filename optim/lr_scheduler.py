"""Warmup learning-rate schedules of the legacy ORTTrainer (`optim.lr_scheduler`).

Every schedule is a pure function of `train_step_info.optimization_step` (completed optimizer
updates) and the base rate `train_step_info.optimizer_config.lr`: lr = base * f(step). A scheduler
object only remembers the last rate it produced, so its state is that rate plus its constructor
hyper-parameters (checked on load, since a schedule resumed with other settings is a silent bug).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "ConstantWarmupLRScheduler",
    "CosineWarmupLRScheduler",
    "LRScheduler",
    "LinearWarmupLRScheduler",
    "PolyWarmupLRScheduler",
]


def _check_number(owner: str, field: str, value: Any, low: float, high: float = math.inf) -> float:
    """float(value) if low <= value < high, else ValueError naming the field and the value."""
    ok_type = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok_type and low <= value < high):
        raise ValueError(f"{owner}: {field} must be a number in [{low}, {high}), got {value!r}")
    return float(value)


class LRScheduler:
    """Base class: subclasses implement `get_lr(train_step_info) -> float`."""

    def __init__(self, total_steps: int, warmup: float):
        owner = type(self).__name__
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"{owner}: total_steps must be a strict positive integer, got {total_steps!r}")
        self.total_steps = total_steps
        self.warmup = _check_number(owner, "warmup", warmup, 0.0, 1.0)
        self._last_lr: list[float] = []

    def get_lr(self, train_step_info: Any) -> float:
        """Learning rate for `train_step_info.optimization_step`."""
        raise NotImplementedError

    def step(self, train_step_info: Any) -> list[float]:
        """Compute, remember and return ``[lr]`` for this step: the trainer calls it before each step.

        The override point is :meth:`get_lr`; this calls ``_step`` (the legacy name, kept for subclasses
        written against ONNX Runtime's legacy scheduler that override it)."""
        return self._step(train_step_info)

    def _step(self, train_step_info: Any) -> list[float]:
        """Compute, remember and return ``[lr]`` for this step (see :meth:`step`)."""
        self._last_lr = [float(self.get_lr(train_step_info))]
        return list(self._last_lr)

    def get_last_lr(self) -> list[float]:
        """``[lr]`` of the last `step` (empty before the first)."""
        return list(self._last_lr)

    def _hyper_parameters(self) -> dict[str, Any]:
        return {"total_steps": self.total_steps, "warmup": self.warmup}

    def state_dict(self) -> dict[str, Any]:
        """``{"name", "hyper_parameters", "last_lr"}``; the schedule itself is stateless."""
        hyper_parameters = self._hyper_parameters()
        return {"name": type(self).__name__, "hyper_parameters": hyper_parameters, "last_lr": self.get_last_lr()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `last_lr`; ValueError if the state belongs to another schedule or other settings."""
        missing = sorted({"name", "hyper_parameters", "last_lr"} - set(state))
        if missing:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing keys {missing}")
        name = state["name"].decode() if isinstance(state["name"], bytes) else str(state["name"])
        if name != type(self).__name__:
            raise ValueError(f"cannot load a {name} state into a {type(self).__name__}")
        mine, theirs = self._hyper_parameters(), dict(state["hyper_parameters"])
        diffs = sorted(
            f"{k}: state has {theirs.get(k, '<missing>')!r}, this scheduler has {v!r}"
            for k, v in mine.items()
            if k not in theirs or float(theirs[k]) != float(v)
        )
        if diffs:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: hyper-parameters differ ({'; '.join(diffs)}). "
                "Construct the scheduler with the settings it was saved with."
            )
        self._last_lr = [float(x) for x in state["last_lr"]]

    def _warmup_multiplier(self, step: int) -> float | None:
        """s / max(1, Wn) during warmup (s < Wn = warmup * total_steps), else None."""
        warmup_steps = self.warmup * self.total_steps
        return step / max(1.0, warmup_steps) if step < warmup_steps else None


def _step_and_base(info: Any) -> tuple[int, float]:
    return info.optimization_step, float(info.optimizer_config.lr)


class ConstantWarmupLRScheduler(LRScheduler):
    """Linear warmup to the base rate, then constant."""

    def __init__(self, total_steps: int, warmup: float = 0.002):
        super().__init__(total_steps, warmup)

    def get_lr(self, train_step_info: Any) -> float:
        step, base = _step_and_base(train_step_info)
        factor = self._warmup_multiplier(step)
        return base * (1.0 if factor is None else factor)


class CosineWarmupLRScheduler(LRScheduler):
    """Linear warmup, then cosine decay over `cycles` periods (0.5: one half cosine down to 0)."""

    def __init__(self, total_steps: int, cycles: float = 0.5, warmup: float = 0.002):
        super().__init__(total_steps, warmup)
        if isinstance(cycles, bool) or not isinstance(cycles, int | float) or not 0 < cycles < math.inf:
            raise ValueError(f"CosineWarmupLRScheduler: cycles must be a number > 0, got {cycles!r}")
        self.cycles = float(cycles)

    def _hyper_parameters(self) -> dict[str, Any]:
        return {**super()._hyper_parameters(), "cycles": self.cycles}

    def get_lr(self, train_step_info: Any) -> float:
        step, base = _step_and_base(train_step_info)
        factor = self._warmup_multiplier(step)
        if factor is None:
            warmup_steps = self.warmup * self.total_steps
            progress = (step - warmup_steps) / max(1.0, self.total_steps - warmup_steps)
            factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * progress)))
        return base * factor


class LinearWarmupLRScheduler(LRScheduler):
    """Linear warmup, then linear decay to 0 at `total_steps`."""

    def __init__(self, total_steps: int, warmup: float = 0.002):
        super().__init__(total_steps, warmup)

    def get_lr(self, train_step_info: Any) -> float:
        step, base = _step_and_base(train_step_info)
        factor = self._warmup_multiplier(step)
        if factor is None:
            warmup_steps = self.warmup * self.total_steps
            factor = max(0.0, (self.total_steps - step) / max(1.0, self.total_steps - warmup_steps))
        return base * factor


class PolyWarmupLRScheduler(LRScheduler):
    """Linear warmup, then polynomial decay (`power`) from the base rate to `lr_end`."""

    def __init__(self, total_steps: int, lr_end: float = 1e-7, power: float = 1.0, warmup: float = 0.002):
        super().__init__(total_steps, warmup)
        self.lr_end = _check_number("PolyWarmupLRScheduler", "lr_end", lr_end, 0.0)
        self.power = _check_number("PolyWarmupLRScheduler", "power", power, 0.0)

    def _hyper_parameters(self) -> dict[str, Any]:
        return {**super()._hyper_parameters(), "lr_end": self.lr_end, "power": self.power}

    def get_lr(self, train_step_info: Any) -> float:
        step, base = _step_and_base(train_step_info)
        if not base > self.lr_end:
            raise ValueError(
                f"PolyWarmupLRScheduler: the optimizer lr ({base}) must be greater than lr_end ({self.lr_end})"
            )
        factor = self._warmup_multiplier(step)
        if factor is not None:
            return base * factor
        if step > self.total_steps:
            return base * (self.lr_end / base)
        warmup_steps = self.warmup * self.total_steps
        remaining = 1.0 - (step - warmup_steps) / (self.total_steps - warmup_steps)
        return base * (((base - self.lr_end) * remaining**self.power + self.lr_end) / base)


# The legacy ORTTrainer spelled the base class `_LRScheduler`; the old name keeps working.
_LRScheduler = LRScheduler
