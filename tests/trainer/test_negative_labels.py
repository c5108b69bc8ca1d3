"""Negative class indices are refused as eager PyTorch refuses them, not trained as the last classes.

ONNX's gather takes -1 as the last element, so a label of -1 would silently train class C-1. The ignore_index
(-100, or the loss's own) must keep working and train equal to PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTModule, ORTTrainer, optim

ce = torch.nn.functional.cross_entropy
DESC = {"inputs": [("x", ["batch", 4]), ("label", ["batch"])], "outputs": [("loss", [], True)]}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _batch(labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(len(labels), 4, generator=torch.Generator().manual_seed(1)), torch.tensor(labels)


def test_train_step_refuses_a_negative_label():
    trainer = ORTTrainer(_model(), DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    trainer.train_step(*_batch([0, 1, 2, 1]))
    before = trainer.state_dict(pytorch_format=True)
    with pytest.raises(ValueError, match=r"'label'.*\[-1\].*\[0, 3\).*-100"):
        trainer.train_step(*_batch([0, -1, 2, 1]))
    for name, value in trainer.state_dict(pytorch_format=True).items():  # the refused step changed nothing
        torch.testing.assert_close(value, before[name], msg=name)


def test_eval_step_refuses_a_negative_label():
    trainer = ORTTrainer(_model(), DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    trainer.eval_step(*_batch([0, 1, 2, 1]))
    with pytest.raises(ValueError, match=r"'label'.*\[-3\].*\[0, 3\)"):
        trainer.eval_step(*_batch([0, -3, 2, 1]))


def test_ignore_index_still_trains_equal_to_torch():
    model = _model()
    reference = copy.deepcopy(model)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-5)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=loss_fn)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for labels in ([0, -5, 2, 1], [-5, 1, 1, 0]):
        x, label = _batch(labels)
        loss = trainer.train_step(x, label)
        opt.zero_grad()
        expected = loss_fn(reference(x), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"'label'.*\[-100\].*ignore_index -5"):  # -100 is not this loss's
        trainer.train_step(*_batch([0, -100, 2, 1]))


def test_default_ignore_index_trains_equal_to_torch():
    model = _model()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, label = _batch([0, -100, 2, -100])
    loss = trainer.train_step(x, label)
    opt.zero_grad()
    expected = ce(reference(x), label)
    expected.backward()
    opt.step()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(trainer.eval_step(x, label), ce(reference(x), label).detach(), atol=1e-6, rtol=1e-6)


class _WithLoss(torch.nn.Module):
    """The loss inside the module, as in ORTModule's custom loops (Hugging Face models with ``labels=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = _model()

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.nll_loss(self.fc(x).log_softmax(-1), label)


def test_ortmodule_refuses_a_negative_label_and_trains_ignore_index_equal_to_torch():
    model = _WithLoss()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x, label = _batch([0, -100, 2, 1])
    loss = wrapped(x, label)
    loss.backward()
    expected = reference(x, label)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model.fc.weight.grad, reference.fc.weight.grad, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[-1\].*\[0, 3\).*-100"):
        wrapped(*_batch([0, -1, 2, 1]))
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[-2\].*\[0, 3\)"):
        wrapped(*_batch([0, -2, 2, 1]))
