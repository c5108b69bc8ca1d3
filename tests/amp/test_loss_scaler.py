"""amp.LossScaler / DynamicLossScaler: the legacy update rule, validation and the state protocol."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ort_trainer.amp import DynamicLossScaler, LossScaler


def _run(scaler: DynamicLossScaler, all_finite: bool, times: int) -> float:
    for _ in range(times):
        scale = scaler.update(SimpleNamespace(all_finite=all_finite))
    return scale


def test_defaults_match_legacy():
    s = DynamicLossScaler()
    assert s.automatic_update is True
    assert s.loss_scale == float(1 << 16) and isinstance(s.loss_scale, float)
    assert s.up_scale_window == 2000
    assert s.min_loss_scale == 1.0
    assert s.max_loss_scale == float(1 << 24)
    assert s.stable_steps == 0
    assert s.input_name is None


def test_scale_doubles_after_up_scale_window_finite_steps():
    s = DynamicLossScaler()
    assert _run(s, True, 1999) == 65536.0
    assert s.stable_steps == 1999
    assert s.update(SimpleNamespace(all_finite=True)) == 131072.0
    assert s.stable_steps == 0


def test_overflow_halves_and_resets_the_window():
    s = DynamicLossScaler(up_scale_window=3)
    _run(s, True, 2)
    assert s.update(False) == 32768.0  # a bare bool is accepted too
    assert s.stable_steps == 0
    assert _run(s, True, 2) == 32768.0  # the window restarted
    assert s.update(True) == 65536.0


@pytest.mark.parametrize(
    ("start", "finite", "steps", "expected"),
    [
        (2.0, False, 5, 1.0),  # clamped at min_loss_scale
        (float(1 << 23), True, 4, float(1 << 24)),  # clamped at max_loss_scale (window 1)
        (3.0, False, 1, 1.5),
    ],
)
def test_update_table_with_clamps(start, finite, steps, expected):
    s = DynamicLossScaler(loss_scale=start, up_scale_window=1)
    assert _run(s, finite, steps) == expected


def test_automatic_update_false_leaves_the_scale_alone():
    s = DynamicLossScaler(automatic_update=False, loss_scale=8.0, up_scale_window=1)
    assert _run(s, False, 3) == 8.0
    assert _run(s, True, 3) == 8.0
    assert s.stable_steps == 0


def test_reset_restores_initial_scale_and_counter():
    s = DynamicLossScaler(loss_scale=4.0, up_scale_window=10)
    _run(s, False, 1)
    _run(s, True, 3)
    s.reset()
    assert (s.loss_scale, s.stable_steps) == (4.0, 0)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "1024", None])
def test_loss_scale_must_be_positive_finite(bad):
    with pytest.raises(ValueError, match="'loss_scale' must be a positive finite float"):
        DynamicLossScaler(loss_scale=bad)
    s = DynamicLossScaler()
    with pytest.raises(ValueError, match="'loss_scale' must be a positive finite float"):
        s.loss_scale = bad
    assert s.loss_scale == 65536.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"automatic_update": 1}, "'automatic_update' must be a bool"),
        ({"up_scale_window": 0}, "'up_scale_window' must be an int >= 1, got 0"),
        ({"up_scale_window": True}, "'up_scale_window' must be an int >= 1, got True"),
        ({"up_scale_window": 2.0}, "'up_scale_window' must be an int >= 1"),
        ({"min_loss_scale": 0.0}, "'min_loss_scale' must be a positive finite float"),
        ({"max_loss_scale": math.inf}, "'max_loss_scale' must be a positive finite float"),
        ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, r"'min_loss_scale' \(8.0\) must be <= 'max_loss_scale'"),
    ],
)
def test_constructor_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


def test_update_rejects_non_bool_all_finite():
    with pytest.raises(ValueError, match="'all_finite' must be a bool, got 1"):
        DynamicLossScaler().update(SimpleNamespace(all_finite=1))


def test_input_name_must_be_non_empty_str():
    s = DynamicLossScaler()
    s.input_name = "loss_scale_input"
    assert s.input_name == "loss_scale_input"
    for bad in ("", 3, None):
        with pytest.raises(ValueError, match="'input_name' must be a non-empty str"):
            s.input_name = bad
    assert s.input_name == "loss_scale_input"


def test_base_class_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        LossScaler(1.0)


def test_state_dict_round_trip():
    s = DynamicLossScaler(up_scale_window=5)
    _run(s, False, 1)
    _run(s, True, 3)
    state = s.state_dict()
    assert state == {
        "loss_scale": 32768.0,
        "stable_steps": 3,
        "automatic_update": True,
        "up_scale_window": 5,
        "min_loss_scale": 1.0,
        "max_loss_scale": float(1 << 24),
    }
    fresh = DynamicLossScaler(up_scale_window=5)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert _run(fresh, True, 2) == _run(s, True, 2) == 65536.0


def test_load_state_accepts_numpy_and_torch_scalars():
    s = DynamicLossScaler()
    state = s.state_dict()
    state.update(loss_scale=np.float32(512.0), stable_steps=torch.tensor(7), up_scale_window=np.int64(2000))
    state["automatic_update"] = np.bool_(True)
    s.load_state_dict(state)
    assert (s.loss_scale, s.stable_steps) == (512.0, 7)
    assert type(s.loss_scale) is float and type(s.stable_steps) is int


def test_load_state_rejects_hyper_parameter_mismatch_and_changes_nothing():
    saved = DynamicLossScaler(up_scale_window=5, max_loss_scale=1024.0, loss_scale=2.0).state_dict()
    s = DynamicLossScaler()
    with pytest.raises(ValueError, match=r"up_scale_window \(saved 5, this scaler 2000\), max_loss_scale"):
        s.load_state_dict(saved)
    assert s.loss_scale == 65536.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_scale": -1.0}, "'loss_scale' must be a positive finite float"),
        ({"stable_steps": -1}, "'stable_steps' must be an int >= 0, got -1"),
        ({"stable_steps": 1.5}, "'stable_steps' must be an int >= 0"),
    ],
)
def test_load_state_validates_values(change, message):
    s = DynamicLossScaler()
    state = {**s.state_dict(), **change}
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(state)


def test_load_state_lists_missing_and_unexpected_keys():
    s = DynamicLossScaler()
    state = s.state_dict()
    del state["stable_steps"]
    state["bogus"] = 1
    with pytest.raises(ValueError, match=r"missing \['stable_steps'\], unexpected \['bogus'\]"):
        s.load_state_dict(state)
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        s.load_state_dict([("loss_scale", 1.0)])
