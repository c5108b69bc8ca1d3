"""ORTTrainer against pure PyTorch: losses and parameters after 20 steps, for the optimizers we ship."""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.models import (
    CNN,
    CNN_DESC,
    LM_DESC,
    MLP,
    MLP_DESC,
    TinyLM,
    cnn_batches,
    lm_batches,
    lm_loss,
    mlp_batches,
)
from tests.trainer import reference_optim as ref

ce = torch.nn.functional.cross_entropy
STEPS = 20


def _torch_run(model, batches, loss_fn, update):
    """Train ``model`` in eager PyTorch; ``update(params, grads)`` applies one optimizer step."""
    losses = []
    model.train()
    for *inputs, label in batches:
        model.zero_grad()
        loss = loss_fn(model(*inputs), label)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            params = [p for p in model.parameters() if p.requires_grad]
            update(params, [p.grad for p in params])
    return losses


def _ort_run(trainer, batches):
    return [trainer.train_step(*batch).item() for batch in batches]


def _assert_same_state(trainer, model, atol):
    got = trainer.state_dict(pytorch_format=True)
    expected = model.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=1e-5, msg=f"state {name} differs")


def _adamw(model, lr, weight_decay=0.0, eps=1e-8):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=weight_decay)
    return lambda params, grads: opt.step()


@pytest.mark.parametrize("clip", [False, True])
def test_mlp_adam_mode0_matches_torch_adamw(clip):
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(
        model,
        MLP_DESC,
        optim.AdamConfig(lr=0.05, lambda_coef=0.01, max_norm_clip=0.5),
        loss_fn=ce,
        options={"utils": {"grad_norm_clip": clip}},
    )
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, eps=1e-8, weight_decay=0.01)

    def update(params, grads):
        if clip:  # the legacy rule: divide by N / M only when the global norm N exceeds M
            divisor = ref.clip_divisor(grads, 0.5)
            for g in grads:
                g.div_(divisor)
        opt.step()

    batches = mlp_batches(STEPS)
    expected = _torch_run(reference, batches, ce, update)
    got = _ort_run(trainer, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_same_state(trainer, reference, atol=2e-6)


def test_mlp_sgd_matches_torch_sgd():
    torch.manual_seed(1)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = mlp_batches(STEPS)
    expected = _torch_run(reference, batches, ce, lambda p, g: opt.step())
    torch.testing.assert_close(torch.tensor(_ort_run(trainer, batches)), torch.tensor(expected), atol=1e-6, rtol=1e-5)
    _assert_same_state(trainer, reference, atol=1e-6)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_mlp_adam_mode1_matches_legacy_formula(bias_correction):
    torch.manual_seed(2)
    model = MLP()
    reference = copy.deepcopy(model)
    config = optim.AdamConfig(
        lr=0.02,
        lambda_coef=0.05,
        do_bias_correction=bias_correction,
        weight_decay_mode=optim.DecayMode.AFTER_WEIGHT_UPDATE,
    )
    trainer = ORTTrainer(model, MLP_DESC, config, loss_fn=ce, options={"utils": {"grad_norm_clip": False}})
    state = {}
    update = lambda p, g: ref.adam_step(p, g, state, lr=0.02, lambda_=0.05, mode=1, bias_correction=bias_correction)  # noqa: E731
    batches = mlp_batches(STEPS)
    expected = _torch_run(reference, batches, ce, update)
    torch.testing.assert_close(torch.tensor(_ort_run(trainer, batches)), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_same_state(trainer, reference, atol=2e-6)


def test_mlp_lamb_matches_legacy_formula_with_clipping():
    torch.manual_seed(3)
    model = MLP()
    reference = copy.deepcopy(model)
    config = optim.LambConfig(lr=0.01, lambda_coef=0.01, ratio_min=0.05, ratio_max=5.0, max_norm_clip=0.3)
    trainer = ORTTrainer(model, MLP_DESC, config, loss_fn=ce)
    state = {}

    def update(params, grads):
        divisor = ref.clip_divisor(grads, 0.3)
        ref.lamb_step(params, grads, state, lr=0.01, lambda_=0.01, ratio_min=0.05, ratio_max=5.0, divisor=divisor)

    batches = mlp_batches(STEPS)
    expected = _torch_run(reference, batches, ce, update)
    torch.testing.assert_close(torch.tensor(_ort_run(trainer, batches)), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_same_state(trainer, reference, atol=2e-6)
    assert trainer.state_dict()["optimizer"]["shared_optimizer_state"]["Step"].item() == STEPS + 1


def test_cnn_batchnorm_statistics_and_eval_match_torch():
    torch.manual_seed(4)
    model = CNN()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(
        model, CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce, options={"utils": {"grad_norm_clip": False}}
    )
    batches = cnn_batches(STEPS)
    expected = _torch_run(reference, batches, ce, _adamw(reference, 0.01))
    got = _ort_run(trainer, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_same_state(trainer, reference, atol=1e-5)  # includes running_mean/var and num_batches_tracked
    x, label = batches[0]
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(x, label), ce(reference(x), label), atol=1e-5, rtol=1e-5)
    # the module shows the trainer's state (utils.share_module_parameters), BatchNorm's integer counter included
    assert model.bn.num_batches_tracked.item() == reference.bn.num_batches_tracked.item() == STEPS


def test_transformer_lm_matches_torch_adamw():
    torch.manual_seed(5)
    model = TinyLM(layers=2)
    reference = copy.deepcopy(model)
    # The attention key bias has an analytically zero gradient (softmax ignores a per-query constant);
    # both frameworks produce ~1e-10 float noise there, which Adam with eps=1e-8 would blow up to
    # lr-sized random steps. eps=1e-6 keeps that noise negligible without changing anything else.
    config = optim.AdamConfig(lr=3e-3, epsilon=1e-6)
    trainer = ORTTrainer(model, LM_DESC, config, loss_fn=lm_loss, options={"utils": {"grad_norm_clip": False}})
    batches = lm_batches(STEPS)
    expected = _torch_run(reference, batches, lm_loss, _adamw(reference, 3e-3, eps=1e-6))
    got = _ort_run(trainer, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=1e-4)
    _assert_same_state(trainer, reference, atol=1e-4)


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(6)
    model = MLP()
    big = ORTTrainer(copy.deepcopy(model), MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    accumulated = ORTTrainer(
        copy.deepcopy(model),
        MLP_DESC,
        optim.AdamConfig(lr=0.01),
        loss_fn=ce,
        options={"batch": {"gradient_accumulation_steps": 4}},
    )
    for x, label in mlp_batches(5, batch=16):
        big.train_step(x, label)
        for part in range(4):
            accumulated.train_step(x[part * 4 : (part + 1) * 4], label[part * 4 : (part + 1) * 4])
    assert accumulated.train_step_info.optimization_step == big.train_step_info.optimization_step == 5
    assert accumulated.train_step_info.step == 20
    a, b = accumulated.state_dict(pytorch_format=True), big.state_dict(pytorch_format=True)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-6, rtol=1e-5)


def test_lr_scheduler_feeds_the_update():
    """SGD makes the LR observable: w_after = w_before - lr * grad; warmup starts at LR 0."""
    torch.manual_seed(7)
    model = MLP()
    scheduler = optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=10, warmup=0.5)
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=1.0), loss_fn=ce, options={"lr_scheduler": scheduler})
    reference = copy.deepcopy(model)
    lrs = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.8]
    batches = mlp_batches(len(lrs))
    expected = _torch_run(reference, batches, ce, _sgd_with_schedule(lrs))
    torch.testing.assert_close(torch.tensor(_ort_run(trainer, batches)), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_same_state(trainer, reference, atol=1e-5)
    assert scheduler.get_last_lr() == pytest.approx([lrs[-1]])


def _sgd_with_schedule(lrs):
    step = iter(lrs)

    def update(params, grads):
        lr = next(step)
        for p, g in zip(params, grads, strict=True):
            p.sub_(lr * g)

    return update
