"""Loss scalers for mixed-precision training.

A loss scaler owns one number, the factor the loss is multiplied by before the backward pass so
that small fp16 gradients do not underflow. ``DynamicLossScaler`` grows it after a window of
finite steps and halves it on overflow (the legacy ORTTrainer rule). Both follow the
``state_dict()`` / ``load_state_dict()`` protocol so the scale survives a checkpoint round trip.
"""

from __future__ import annotations

import abc
import math
import numbers
from typing import Any, Protocol

__all__ = ["DynamicLossScaler", "LossScaler"]


class _HasAllFinite(Protocol):
    all_finite: bool


def _as_scalar(value: Any) -> Any:
    """Unwrap 0-d numpy/torch scalars (what HDF5 and torch hand back) into Python numbers."""
    if not isinstance(value, bool | int | float) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _positive_float(name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a finite real number > 0, else raise ValueError naming ``name``."""
    value = _as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"'{name}' must be a positive finite float, got {value!r} ({type(value).__name__})")
    return float(value)


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer (not bool) >= ``minimum``, else raise ValueError."""
    value = _as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"'{name}' must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    """Return ``value`` as a bool if it is a Python/numpy/torch boolean, else raise ValueError."""
    value = _as_scalar(value)
    if not isinstance(value, bool):
        raise ValueError(f"'{name}' must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


class LossScaler(abc.ABC):
    """Base class: holds the current loss scale and the name of the graph input it is fed to.

    Subclasses implement ``update(train_step_info)``, called by the trainer after every optimizer
    step with the step's ``all_finite`` flag, and return the new scale.
    """

    def __init__(self, loss_scale: float) -> None:
        self._initial_loss_scale = _positive_float("loss_scale", loss_scale)
        self._loss_scale = self._initial_loss_scale
        self._input_name: str | None = None

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a finite float > 0)."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._loss_scale = _positive_float("loss_scale", value)

    @property
    def input_name(self) -> str | None:
        """Name of the graph input the scale is fed to; None until the trainer sets it."""
        return self._input_name

    @input_name.setter
    def input_name(self, value: str) -> None:
        # The legacy setter asserted `not input_name` (inverted); a name must be a non-empty str.
        if not isinstance(value, str) or not value:
            raise ValueError(f"'input_name' must be a non-empty str, got {value!r} ({type(value).__name__})")
        self._input_name = value

    def reset(self) -> None:
        """Restore the loss scale given at construction."""
        self._loss_scale = self._initial_loss_scale

    @abc.abstractmethod
    def update(self, train_step_info: _HasAllFinite | bool) -> float:
        """Update the scale after an optimizer step and return the new value."""

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: ``{"loss_scale": float}`` (subclasses add their own entries)."""
        return {"loss_scale": self._loss_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate ``state_dict`` completely, then assign; a failure changes nothing."""
        values = self._validate_state(state_dict)
        self._assign_state(values)

    def _validate_state(self, state_dict: Any) -> dict[str, Any]:
        """Check keys (missing/unexpected, all listed) and return the converted values."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"{type(self).__name__} state_dict must be a dict, got {type(state_dict).__name__}")
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{type(self).__name__} state_dict keys do not match: missing {missing}, unexpected {unexpected}; "
                f"expected exactly {sorted(expected)}"
            )
        return {"loss_scale": _positive_float("loss_scale", state_dict["loss_scale"])}

    def _assign_state(self, values: dict[str, Any]) -> None:
        self._loss_scale = values["loss_scale"]


class DynamicLossScaler(LossScaler):
    """Grow the scale x2 after ``up_scale_window`` consecutive finite steps, halve it on overflow.

    The scale stays within ``[min_loss_scale, max_loss_scale]``. With ``automatic_update=False``
    ``update()`` leaves the scale alone (the user drives ``loss_scale`` directly).
    """

    _HYPER_PARAMETERS = ("automatic_update", "up_scale_window", "min_loss_scale", "max_loss_scale")

    def __init__(
        self,
        automatic_update: bool = True,
        loss_scale: float = float(1 << 16),
        up_scale_window: int = 2000,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = float(1 << 24),
    ) -> None:
        super().__init__(loss_scale)
        self.automatic_update = _bool("automatic_update", automatic_update)
        self.up_scale_window = _int_at_least("up_scale_window", up_scale_window, 1)
        self.min_loss_scale = _positive_float("min_loss_scale", min_loss_scale)
        self.max_loss_scale = _positive_float("max_loss_scale", max_loss_scale)
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError(
                f"'min_loss_scale' ({self.min_loss_scale}) must be <= 'max_loss_scale' ({self.max_loss_scale})"
            )
        self._stable_steps_count = 0

    @property
    def stable_steps(self) -> int:
        """Number of consecutive finite steps since the scale last changed."""
        return self._stable_steps_count

    def reset(self) -> None:
        """Restore the initial scale and forget the stable-step count."""
        super().reset()
        self._stable_steps_count = 0

    def update(self, train_step_info: _HasAllFinite | bool) -> float:
        """Apply the legacy rule to ``train_step_info.all_finite`` (or a bare bool); return the scale."""
        if not self.automatic_update:
            return self._loss_scale
        raw = train_step_info if isinstance(train_step_info, bool) else train_step_info.all_finite
        if _bool("all_finite", raw):
            self._stable_steps_count += 1
            if self._stable_steps_count >= self.up_scale_window:
                self._loss_scale = min(self.max_loss_scale, self._loss_scale * 2)
                self._stable_steps_count = 0
        else:
            self._loss_scale = max(self.min_loss_scale, self._loss_scale / 2)
            self._stable_steps_count = 0
        return self._loss_scale

    def state_dict(self) -> dict[str, Any]:
        """``loss_scale``, ``stable_steps`` and the hyper-parameters (checked again on load)."""
        state = super().state_dict()
        state["stable_steps"] = self._stable_steps_count
        state.update({name: getattr(self, name) for name in self._HYPER_PARAMETERS})
        return state

    def _validate_state(self, state_dict: Any) -> dict[str, Any]:
        values = super()._validate_state(state_dict)
        values["stable_steps"] = _int_at_least("stable_steps", state_dict["stable_steps"], 0)
        loaded = {
            "automatic_update": _bool("automatic_update", state_dict["automatic_update"]),
            "up_scale_window": _int_at_least("up_scale_window", state_dict["up_scale_window"], 1),
            "min_loss_scale": _positive_float("min_loss_scale", state_dict["min_loss_scale"]),
            "max_loss_scale": _positive_float("max_loss_scale", state_dict["max_loss_scale"]),
        }
        mismatched = [
            f"{name} (saved {loaded[name]!r}, this scaler {getattr(self, name)!r})"
            for name in self._HYPER_PARAMETERS
            if loaded[name] != getattr(self, name)
        ]
        if mismatched:
            raise ValueError(
                "DynamicLossScaler hyper-parameters differ from the saved state: "
                + ", ".join(mismatched)
                + "; construct the scaler with the saved values to resume"
            )
        return values

    def _assign_state(self, values: dict[str, Any]) -> None:
        super()._assign_state(values)
        self._stable_steps_count = values["stable_steps"]
