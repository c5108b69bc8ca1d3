"""TrainStepInfo: validation instead of asserts, no shared mutable default, state round trip."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ort_trainer.train_step_info import TrainStepInfo


@pytest.fixture
def config():
    """A real optim config when optim.config is importable, else a stand-in with .lr and .name."""
    try:
        from ort_trainer.optim.config import AdamConfig
    except ImportError:
        return SimpleNamespace(name="AdamOptimizer", lr=0.001)
    return AdamConfig()


def test_defaults(config):
    info = TrainStepInfo(config)
    assert info.optimizer_config is config
    assert info.all_finite is True
    assert info.fetches == []
    assert (info.optimization_step, info.step) == (0, 0)


def test_fetches_default_is_not_shared_and_argument_is_copied(config):
    a, b = TrainStepInfo(config), TrainStepInfo(config)
    a.fetches.append("loss")
    assert b.fetches == []
    names = ["loss"]
    c = TrainStepInfo(config, fetches=names)
    names.append("probs")
    assert c.fetches == ["loss"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"all_finite": 1}, TypeError, "'all_finite' must be a bool, got 1"),
        ({"fetches": "loss"}, TypeError, "'fetches' must be a list of str, got str"),
        ({"fetches": ["loss", 3]}, TypeError, r"non-str entries: \[1\]=3"),
        ({"optimization_step": -1}, ValueError, "'optimization_step' must be an int >= 0, got -1"),
        ({"optimization_step": True}, ValueError, "'optimization_step' must be an int >= 0, got True"),
        ({"step": 1.0}, ValueError, "'step' must be an int >= 0, got 1.0"),
    ],
)
def test_constructor_validation(config, kwargs, error, message):
    with pytest.raises(error, match=message):
        TrainStepInfo(config, **kwargs)


def test_optimizer_config_type_is_checked():
    with pytest.raises(TypeError, match="'optimizer_config' must be an? .*got dict"):
        TrainStepInfo({"lr": 0.1})


def test_assignment_is_validated(config):
    info = TrainStepInfo(config)
    info.step = 3
    info.all_finite = np.bool_(False)  # what a session hands back
    assert info.all_finite is False
    with pytest.raises(ValueError, match="'step' must be an int >= 0, got -2"):
        info.step = -2
    assert info.step == 3


def test_state_round_trip(config):
    info = TrainStepInfo(config, optimization_step=4, step=9)
    state = info.state_dict()
    assert state == {"optimization_step": 4, "step": 9}
    fresh = TrainStepInfo(config)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_load_state_converts_numpy_and_torch_integers(config):
    info = TrainStepInfo(config)
    info.load_state_dict({"optimization_step": np.int64(2), "step": torch.tensor(5)})
    assert info.state_dict() == {"optimization_step": 2, "step": 5}
    assert type(info.step) is int and type(info.optimization_step) is int


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"optimization_step": 1}, r"missing \['step'\]"),
        ({"optimization_step": 1, "step": 2, "epoch": 0}, r"unexpected \['epoch'\]"),
        ({"optimization_step": -1, "step": 2}, "'optimization_step' must be an int >= 0, got -1"),
        ({"optimization_step": 1, "step": np.float64(2.0)}, "'step' must be an int >= 0"),
        ({"optimization_step": 1, "step": False}, "'step' must be an int >= 0, got False"),
    ],
)
def test_load_state_rejects_bad_state_and_changes_nothing(config, state, message):
    info = TrainStepInfo(config, optimization_step=7, step=8)
    with pytest.raises(ValueError, match=message):
        info.load_state_dict(state)
    assert info.state_dict() == {"optimization_step": 7, "step": 8}
