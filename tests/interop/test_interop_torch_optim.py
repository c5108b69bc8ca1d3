"""Optimizer state in torch's format, both ways: export equals `get_optimizer_state_dict`, import continues a run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ort_trainer import ORTTrainer, optim
from tests.models import MLP, MLP_DESC, mlp_batches
from tests.trees import assert_trees_equal

ce = torch.nn.functional.cross_entropy
LR, DECAY = 0.02, 0.01
GROUPS = [{"params": ["fc1.bias", "fc2.bias"], "lambda_coef": 0.0}]


def _trainer(model, config=None):
    config = config or optim.AdamConfig(lr=LR, lambda_coef=DECAY, params=GROUPS)
    return ORTTrainer(model, MLP_DESC, config, loss_fn=ce, options={"utils": {"grad_norm_clip": False}})


def _torch_adamw(model):
    named = dict(model.named_parameters())
    no_decay = [named["fc1.bias"], named["fc2.bias"]]
    rest = [named["fc1.weight"], named["fc2.weight"]]
    return torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": rest}], lr=LR, weight_decay=DECAY)


def _torch_steps(model, opt, batches):
    losses = []
    for x, label in batches:
        opt.zero_grad()
        loss = ce(model(x), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_close_trees(got, expected, atol=2e-6, path="state"):
    if isinstance(expected, dict):
        assert sorted(got) == sorted(expected), f"{path}: {sorted(got)} != {sorted(expected)}"
        for key in expected:
            _assert_close_trees(got[key], expected[key], atol, f"{path}/{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _assert_close_trees(g, e, atol, f"{path}/{i}")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5, msg=path)
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def test_export_equals_torch_get_optimizer_state_dict_after_the_same_steps():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = _trainer(model)
    opt = _torch_adamw(reference)
    batches = mlp_batches(6)
    losses = [trainer.train_step(*b).item() for b in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_torch_steps(reference, opt, batches)))
    expected = get_optimizer_state_dict(reference, opt)
    got = trainer.optimizer_state_dict()
    assert got["state"]["fc1.weight"]["step"].item() == 6.0
    assert list(got["state"]) == list(expected["state"])
    _assert_close_trees(got, expected)


def test_export_before_the_first_step_has_zero_moments_at_step_zero():
    got = _trainer(MLP()).optimizer_state_dict()
    assert list(got["state"]) == ["fc1.bias", "fc2.bias", "fc1.weight", "fc2.weight"]
    for entry in got["state"].values():
        assert entry["step"].item() == 0.0 and not entry["exp_avg"].any() and not entry["exp_avg_sq"].any()


def test_a_run_moves_ort_to_torch_to_ort_and_continues():
    batches = mlp_batches(9)
    torch.manual_seed(0)
    start = MLP()
    uninterrupted = _trainer(copy.deepcopy(start))
    expected = [uninterrupted.train_step(*b).item() for b in batches]

    first = _trainer(copy.deepcopy(start))
    losses = [first.train_step(*b).item() for b in batches[:3]]
    model = MLP()
    model.load_state_dict(first.state_dict(pytorch_format=True), strict=True)
    opt = _torch_adamw(model)
    set_optimizer_state_dict(model, opt, first.optimizer_state_dict())
    losses += _torch_steps(model, opt, batches[3:6])

    second = _trainer(MLP())
    second.load_state_dict(model.state_dict())
    second.load_optimizer_state_dict(opt.state_dict(), model=model)  # torch's own int-keyed layout
    assert second.train_step_info.optimization_step == 3 + 3
    imported = second.state_dict()["optimizer"]
    losses += [second.train_step(*b).item() for b in batches[6:]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    final = second.state_dict(pytorch_format=True)
    for name, value in uninterrupted.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(final[name], value, atol=2e-6, rtol=1e-5)

    third = _trainer(MLP())  # the fqn-keyed layout of get_optimizer_state_dict loads the same
    third.load_optimizer_state_dict(get_optimizer_state_dict(model, opt))
    assert_trees_equal(third.state_dict()["optimizer"], imported)


def test_sgd_exports_torch_sgd_format():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, optim.SGDConfig(lr=0.1))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = mlp_batches(2)
    for b in batches:
        trainer.train_step(*b)
    _torch_steps(reference, opt, batches)
    assert trainer.optimizer_state_dict() == get_optimizer_state_dict(reference, opt)


@pytest.mark.parametrize(
    ("config", "option"),
    [
        (optim.LambConfig(lr=0.01), "LambOptimizer"),
        (optim.AdamConfig(weight_decay_mode=optim.DecayMode.AFTER_WEIGHT_UPDATE), "weight_decay_mode"),
        (optim.AdamConfig(do_bias_correction=False), "do_bias_correction"),
    ],
)
def test_hyperparameters_torch_cannot_express_are_named(config, option):
    trainer = _trainer(MLP(), config)
    with pytest.raises(ValueError, match=option):
        trainer.optimizer_state_dict()
    model = MLP()
    with pytest.raises(ValueError, match=option):
        trainer.load_optimizer_state_dict(get_optimizer_state_dict(model, torch.optim.AdamW(model.parameters())))


def _stepped_state(opt_factory):
    torch.manual_seed(0)
    model = MLP()
    opt = opt_factory(model)
    _torch_steps(model, opt, mlp_batches(2))
    return model, opt


@pytest.mark.parametrize(
    ("factory", "config", "pattern"),
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), optim.SGDConfig(lr=0.1), "momentum"),
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), optim.AdamConfig(lambda_coef=0.01), "amsgrad"),
        (
            lambda m: torch.optim.AdamW(m.parameters(), betas=(0.8, 0.99)),
            optim.AdamConfig(lambda_coef=0.01),
            r"betas.*\(0.8, 0.99\)",
        ),
        (
            lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1),
            optim.AdamConfig(lambda_coef=0.1),
            "decoupled_weight_decay",
        ),
    ],
)
def test_imports_refuse_what_this_trainer_cannot_continue(factory, config, pattern):
    model, opt = _stepped_state(factory)
    trainer = _trainer(MLP(), config)
    before = trainer.state_dict()
    with pytest.raises(ValueError, match=pattern):
        trainer.load_optimizer_state_dict(opt.state_dict(), model=model)
    assert_trees_equal(trainer.state_dict(), before)


def test_import_checks_steps_shapes_and_names():
    model, opt = _stepped_state(lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    trainer = _trainer(MLP(), optim.AdamConfig(lr=LR, lambda_coef=0.01))
    state = get_optimizer_state_dict(model, opt)
    state["state"]["fc2.bias"]["step"] = torch.tensor(5.0)
    with pytest.raises(ValueError, match=r"state\[fc2.bias\]\[step\] is 5, but .*other parameters are at step 2"):
        trainer.load_optimizer_state_dict(state)
    state = get_optimizer_state_dict(model, opt)
    state["state"]["fc1.weight"]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"state\[fc1.weight\]\[exp_avg\].*shape"):
        trainer.load_optimizer_state_dict(state)
    state = get_optimizer_state_dict(model, opt)
    state["state"]["fc1.w"] = state["state"].pop("fc1.weight")
    with pytest.raises(KeyError, match=r"missing.*'fc1.weight'.*unexpected.*'fc1.w'"):
        trainer.load_optimizer_state_dict(state)
    with pytest.raises(ValueError, match="model="):
        trainer.load_optimizer_state_dict(opt.state_dict())  # int keys need the model to name them
