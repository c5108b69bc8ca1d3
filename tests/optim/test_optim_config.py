"""AdamConfig / LambConfig / SGDConfig: legacy names and defaults, parameter groups, validation."""

import inspect
import math

import pytest

from ort_trainer import optim
from ort_trainer.optim import AdamConfig, DecayMode, LambConfig, SGDConfig


def test_public_surface():
    assert set(optim.__all__) == {
        "AdamConfig",
        "DecayMode",
        "FlatLayout",
        "FlatOptimizer",
        "LambConfig",
        "ParamSlot",
        "SGDConfig",
        "lr_scheduler",
    }
    assert AdamConfig.DecayMode is DecayMode  # legacy spelling AdamConfig.DecayMode.X still works
    assert int(DecayMode.BEFORE_WEIGHT_UPDATE) == 0 and int(DecayMode.AFTER_WEIGHT_UPDATE) == 1


def test_legacy_defaults():
    adam, lamb, sgd = AdamConfig(), LambConfig(), SGDConfig()
    assert (adam.name, lamb.name, sgd.name) == ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")
    assert adam.defaults == {
        "lr": 0.001,
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "epsilon": 1e-8,
        "max_norm_clip": 1.0,
        "do_bias_correction": True,
        "weight_decay_mode": DecayMode.BEFORE_WEIGHT_UPDATE,
    }
    assert lamb.defaults == {
        "lr": 0.001,
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "ratio_min": -math.inf,
        "ratio_max": math.inf,
        "epsilon": 1e-6,
        "max_norm_clip": 1.0,
        "do_bias_correction": False,
    }
    assert sgd.defaults == {"lr": 0.001} and sgd.params == [] and adam.params == []
    assert isinstance(SGDConfig(lr=2).lr, float) and SGDConfig(lr=2).lr == 2.0
    assert (adam.alpha, adam.lambda_coef, lamb.epsilon, lamb.ratio_max) == (0.9, 0.0, 1e-6, math.inf)


def test_no_shared_mutable_state_and_caller_groups_untouched():
    groups = [{"params": ["fc1.weight"], "lambda_coef": 0.5}]
    first = AdamConfig(groups)
    assert groups == [{"params": ["fc1.weight"], "lambda_coef": 0.5}]  # not mutated, not renamed
    first.defaults["alpha"] = 0.1
    first.params[0]["params"].append("x")
    assert AdamConfig().defaults["alpha"] == 0.9 and AdamConfig(groups).params[0]["params"] == ["fc1.weight"]


def test_parameter_groups_are_filled_and_renamed():
    cfg = LambConfig(
        [{"params": ["a", "b"], "alpha": 0.8, "lambda_coef": 0.1}, {"params": ["c"], "lambda": 0.2}],
        lr=0.01,
        epsilon=1e-4,
    )
    first = cfg.params[0]
    assert first["params"] == ["a", "b"] and first["alpha"] == 0.8 and first["lambda"] == 0.1
    assert "lambda_coef" not in first and first["epsilon"] == 1e-4 and first["lr"] == 0.01
    assert cfg.hyper_parameters("b")["alpha"] == 0.8 and "lr" not in cfg.hyper_parameters("b")
    assert cfg.hyper_parameters("c")["lambda"] == 0.2
    assert cfg.hyper_parameters("z") == {k: v for k, v in cfg.defaults.items() if k != "lr"}
    assert [cfg.group_index(n) for n in ("a", "b", "c", "z")] == [0, 0, 1, 2]


def test_first_matching_group_wins():
    cfg = AdamConfig([{"params": ["a"], "alpha": 0.5}, {"params": ["a", "b"], "alpha": 0.6}])
    assert cfg.group_index("a") == 0 and cfg.hyper_parameters("a")["alpha"] == 0.5
    assert cfg.hyper_parameters("b")["alpha"] == 0.6


def test_check_param_names_lists_every_unknown_name():
    cfg = AdamConfig([{"params": ["fc1.weight", "fc9.bias"], "alpha": 0.5}, {"params": ["emb"], "beta": 0.9}])
    cfg.check_param_names(["fc1.weight", "fc9.bias", "emb", "other"])
    with pytest.raises(ValueError, match=r"2 parameter\(s\) .*params\[0\]: 'fc9.bias'; params\[1\]: 'emb'"):
        cfg.check_param_names(["fc1.weight"])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"lr": -1}, ValueError, r"AdamConfig: 'lr' must be a finite number >= 0, got -1"),
        ({"lr": "0.1"}, TypeError, r"'lr' must be a number, got '0.1' \(str\)"),
        ({"alpha": 1.5}, ValueError, r"'alpha' must be in \[0, 1\).*got 1.5"),
        ({"beta": -0.1}, ValueError, r"'beta' must be in \[0, 1\).*got -0.1"),
        ({"lambda_coef": -0.01}, ValueError, r"'lambda_coef' must be a finite number >= 0, got -0.01"),
        ({"epsilon": float("nan")}, ValueError, r"'epsilon' must not be NaN"),
        ({"max_norm_clip": 0}, ValueError, r"'max_norm_clip' must be a positive number .*got 0"),
        ({"max_norm_clip": -1.0}, ValueError, r"'max_norm_clip' must be a positive number .*got -1.0"),
        ({"do_bias_correction": 1}, TypeError, r"'do_bias_correction' must be a bool, got 1 \(int\)"),
        ({"weight_decay_mode": 2}, ValueError, r"'weight_decay_mode' must be one of DecayMode.BEFORE_WEIGHT_UPDATE, "),
        ({"weight_decay_mode": "after"}, ValueError, r"'weight_decay_mode' must be one of .* got 'after'"),
    ],
)
def test_adam_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        AdamConfig(**kwargs)


def test_weight_decay_mode_accepts_plain_ints():
    assert AdamConfig(weight_decay_mode=1).weight_decay_mode is DecayMode.AFTER_WEIGHT_UPDATE


def test_lamb_validation():
    with pytest.raises(ValueError, match=r"'ratio_min' \(2.0\) must not exceed 'ratio_max' \(1.0\)"):
        LambConfig(ratio_min=2.0, ratio_max=1.0)
    with pytest.raises(
        ValueError, match=r"LambConfig: params\[0\]: 'ratio_min' \(5.0\) must not exceed 'ratio_max' \(1.0\)"
    ):
        LambConfig([{"params": ["a"], "ratio_max": 1.0, "ratio_min": 5.0}])
    with pytest.raises(TypeError, match=r"'ratio_max' must be a number, got None"):
        LambConfig(ratio_max=None)
    with pytest.raises(ValueError, match=r"LambConfig: 'max_norm_clip' must be a positive number"):
        LambConfig(max_norm_clip=0.0)


def test_group_validation():
    with pytest.raises(ValueError, match=r"params\[0\]: per-group 'lr' is not supported"):
        AdamConfig([{"params": ["a"], "lr": 0.1}])
    valid = "alpha, beta, do_bias_correction, epsilon, lambda, lr, max_norm_clip, weight_decay_mode"
    with pytest.raises(ValueError, match=rf"params\[1\]: unknown hyper-parameter 'gamma'; valid: {valid}"):
        AdamConfig([{"params": ["a"], "alpha": 0.5}, {"params": ["b"], "gamma": 0.1}])
    with pytest.raises(ValueError, match=r"unknown hyper-parameter 'weight_decay_mode'; valid: alpha,"):
        LambConfig([{"params": ["a"], "weight_decay_mode": DecayMode.BEFORE_WEIGHT_UPDATE}])
    with pytest.raises(ValueError, match=r"AdamConfig: params\[0\]: 'alpha' must be in \[0, 1\)"):
        AdamConfig([{"params": ["a"], "alpha": 2.0}])
    with pytest.raises(ValueError, match=r"params\[0\]: each parameter group must be a dict with a 'params' list"):
        AdamConfig([{"alpha": 0.5}])
    with pytest.raises(TypeError, match=r"params\[0\]: 'params' must be a list of parameter names, got 'fc1'"):
        AdamConfig([{"params": "fc1", "alpha": 0.5}])
    with pytest.raises(TypeError, match=r"parameter names must be strings, got 3"):
        AdamConfig([{"params": ["a", 3], "alpha": 0.5}])
    with pytest.raises(ValueError, match=r"needs at least one hyper-parameter besides 'params'"):
        AdamConfig([{"params": ["a"]}])
    with pytest.raises(ValueError, match=r"either 'lambda_coef' or 'lambda', not both"):
        AdamConfig([{"params": ["a"], "lambda": 0.1, "lambda_coef": 0.2}])
    with pytest.raises(TypeError, match=r"'params' must be a list of parameter-group dicts, got dict"):
        AdamConfig({"params": ["a"], "alpha": 0.5})


def test_sgd_rejects_parameter_groups():
    with pytest.raises(ValueError, match=r"'params' must be an empty list for SGD optimizer .*got 1 group\(s\)"):
        SGDConfig([{"params": ["layer1.weight"], "lr": 0.1}], lr=0.002)
    with pytest.raises(ValueError, match=r"SGDConfig: 'lr' must be a finite number >= 0, got -0.5"):
        SGDConfig(lr=-0.5)


# PyTorch's keywords (torch.optim.AdamW's): what every PyTorch user types first
TORCH_KWARGS = {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
OUR_KWARGS = {"alpha": 0.8, "beta": 0.95, "epsilon": 1e-6, "lambda_coef": 0.1}


@pytest.mark.parametrize("config", [AdamConfig, LambConfig])
def test_pytorch_names_set_our_hyper_parameters(config):
    spelled = config(lr=0.01, **TORCH_KWARGS)
    assert spelled.defaults == config(lr=0.01, **OUR_KWARGS).defaults
    assert (spelled.alpha, spelled.beta, spelled.epsilon, spelled.lambda_coef) == (0.8, 0.95, 1e-6, 0.1)
    groups = [{"params": ["a"], "weight_decay": 0.0, "betas": [0.5, 0.6]}, {"params": ["b"], "eps": 1e-3}]
    cfg = config(groups, **TORCH_KWARGS)
    assert groups[0] == {"params": ["a"], "weight_decay": 0.0, "betas": [0.5, 0.6]}  # the caller's dict untouched
    assert cfg.hyper_parameters("a") == {**cfg.hyper_parameters("z"), "lambda": 0.0, "alpha": 0.5, "beta": 0.6}
    assert cfg.hyper_parameters("b") == {**cfg.hyper_parameters("z"), "epsilon": 1e-3}
    assert cfg.hyper_parameters("z")["lambda"] == 0.1


@pytest.mark.parametrize(
    "kwargs, ours",
    [
        ({"weight_decay": 0.1, "lambda_coef": 0.1}, "'lambda_coef'"),
        ({"eps": 1e-6, "epsilon": 1e-8}, "'epsilon'"),  # the default's value, given: still both
        ({"betas": (0.9, 0.999), "beta": 0.99}, "'beta'"),
        ({"betas": (0.9, 0.999), "alpha": 0.9, "beta": 0.99}, "'alpha', 'beta'"),
    ],
)
def test_both_spellings_of_one_hyper_parameter_are_refused(kwargs, ours):
    torch_name = next(k for k in kwargs if k in TORCH_KWARGS)
    for config in (AdamConfig, LambConfig):
        message = rf"{config.__name__}: got both '{torch_name}' \(PyTorch's name\) and {ours}: give one of them"
        with pytest.raises(TypeError, match=message):
            config(**kwargs)
    with pytest.raises(
        ValueError, match=r"params\[0\]: give either 'weight_decay' \(PyTorch's name\) or 'lambda_coef'"
    ):
        AdamConfig([{"params": ["a"], "lambda_coef": 0.1, "weight_decay": 0.1}])
    with pytest.raises(ValueError, match=r"params\[0\]: give either 'betas' \(PyTorch's name\) or 'alpha'"):
        LambConfig([{"params": ["a"], "alpha": 0.5, "betas": (0.5, 0.6)}])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"betas": (1.5, 0.9)}, ValueError, r"AdamConfig: 'betas\[0\]' must be in \[0, 1\).*got 1.5"),
        ({"betas": (0.9, -0.1)}, ValueError, r"AdamConfig: 'betas\[1\]' must be in \[0, 1\).*got -0.1"),
        ({"betas": 0.9}, TypeError, r"AdamConfig: 'betas' must be a pair \(beta1, beta2\) of numbers, got 0.9"),
        ({"betas": (0.9, 0.99, 0.5)}, TypeError, r"'betas' must be a pair \(beta1, beta2\) of numbers, got \(0.9"),
        ({"eps": -1.0}, ValueError, r"AdamConfig: 'eps' must be a finite number >= 0, got -1.0"),
        ({"weight_decay": "0.1"}, TypeError, r"AdamConfig: 'weight_decay' must be a number, got '0.1' \(str\)"),
    ],
)
def test_pytorch_names_are_validated_under_their_own_names(kwargs, error, message):
    with pytest.raises(error, match=message):
        AdamConfig(**kwargs)


def test_the_signature_keeps_the_legacy_order_and_defaults():
    """Positional calls of legacy scripts keep their meaning; the shown defaults are the legacy numbers."""
    cfg = AdamConfig(None, 0.01, 0.8, 0.95, 0.1, 1e-6)
    assert cfg.defaults == AdamConfig(lr=0.01, **OUR_KWARGS).defaults
    parameters = inspect.signature(AdamConfig).parameters
    assert [parameters[n].default for n in ("alpha", "beta", "lambda_coef", "epsilon")] == [0.9, 0.999, 0.0, 1e-8]
    assert repr(parameters["alpha"].default) == "0.9"
    assert all(parameters[n].kind is inspect.Parameter.KEYWORD_ONLY for n in TORCH_KWARGS)


def test_sgd_takes_pytorchs_momentum_and_weight_decay_only_when_they_change_nothing():
    """The legacy SGDOptimizer is plain w -= lr * g: torch.optim.SGD's momentum and weight_decay at 0 are that."""
    assert SGDConfig(lr=0.1, momentum=0.0, weight_decay=0).defaults == SGDConfig(lr=0.1).defaults == {"lr": 0.1}
    message = r"SGDConfig: momentum=0.9 is not supported: this SGD is plain w -= lr \* g .*AdamConfig"
    with pytest.raises(ValueError, match=message):
        SGDConfig(lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"SGDConfig: momentum=0.9, weight_decay=0.01 are not supported"):
        SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.01)
    with pytest.raises(TypeError, match=r"SGDConfig: 'momentum' must be a number, got '0.9' \(str\)"):
        SGDConfig(momentum="0.9")
