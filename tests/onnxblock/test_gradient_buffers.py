"""The gradient buffers the optimizer reads hold PyTorch's gradients: overwritten at the start of each
accumulation cycle, summed (then averaged) within one. SGD with lr 1 makes them observable as the update.

(Kept from an experiment that bound the gradients as graph outputs instead of ``InPlaceAccumulatorV2``:
no faster, see docs/performance.md; the behaviour these tests pin holds for either form.)
"""

from __future__ import annotations

import copy

import torch

from ort_trainer import ORTTrainer, optim
from tests.models import LM_DESC, TinyLM, lm_batches, lm_loss
from tests.onnxblock.graph_compare import torch_loss_and_grads


def _lm():
    torch.manual_seed(0)
    return TinyLM(vocab=64, d_model=16, layers=2, heads=2)


def _sgd_trainer(model, accumulation):
    options = {"utils": {"grad_norm_clip": False}, "batch": {"gradient_accumulation_steps": accumulation}}
    return ORTTrainer(copy.deepcopy(model), LM_DESC, optim.SGDConfig(lr=1.0), loss_fn=lm_loss, options=options)


def _assert_step_is_minus_gradient(trainer, before, expected_grads, steps):
    after = trainer.state_dict(pytorch_format=True)
    for name, grad in expected_grads.items():
        step = before[name] - after[name]  # SGD, lr 1: the gradient (the mean over the accumulated steps)
        scale = grad.abs().max().item()
        error = (step - grad).abs().max().item()
        assert error <= 1e-5 * scale + 1e-7, f"{name} after {steps} steps: max error {error:.3g} vs {scale:.3g}"


def test_trainer_buffers_receive_torch_gradients_with_and_without_accumulation():
    model = _lm()
    batches = lm_batches(3, batch=3, seq=10, vocab=64)
    for accumulation in (1, 3):
        trainer = _sgd_trainer(model, accumulation)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        per_batch = [torch_loss_and_grads(model, lm_loss, b)[1] for b in batches[:accumulation]]
        expected = {name: sum(g[name] for g in per_batch) / accumulation for name in per_batch[0]}
        for batch in batches[:accumulation]:
            trainer.train_step(*batch)
        _assert_step_is_minus_gradient(trainer, before, expected, accumulation)


def test_a_second_cycle_overwrites_the_accumulated_gradients():
    """Accumulate (add) then start a new cycle (overwrite): the second update uses only its own batches."""
    model = _lm()
    batches = lm_batches(4, batch=3, seq=10, vocab=64)
    trainer = _sgd_trainer(model, 2)
    for batch in batches[:2]:
        trainer.train_step(*batch)
    middle = trainer.state_dict(pytorch_format=True)
    reference = copy.deepcopy(model)
    reference.load_state_dict(middle)
    per_batch = [torch_loss_and_grads(reference, lm_loss, b)[1] for b in batches[2:]]
    expected = {name: (per_batch[0][name] + per_batch[1][name]) / 2 for name in per_batch[0]}
    for batch in batches[2:]:
        trainer.train_step(*batch)
    _assert_step_is_minus_gradient(trainer, middle, expected, 4)
