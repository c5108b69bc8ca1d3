"""model_desc inputs reach forward() by name, as the legacy ORTTrainer bound them (checked against PyTorch)."""

from __future__ import annotations

import pytest
import torch

from tests.builders import sgd_trainer

ce = torch.nn.functional.cross_entropy


class AB(torch.nn.Module):
    """forward(a, b) is not symmetric in a and b: swapping them changes the result."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([[1.0, 2.0, -1.0], [3.0, -1.0, 0.5]]))

    def forward(self, a, b):
        return (a @ self.w) * 2 - b


class ABLoss(AB):
    """The model computes its own loss: forward(a, b, label)."""

    def forward(self, a, b, label):
        return ce(super().forward(a, b), label)


class Star(AB):
    def forward(self, *inputs):
        return super().forward(*inputs)


class Keywords(AB):
    def forward(self, a, **extra):
        return super().forward(a, extra["b"])


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 2, generator=g), torch.randn(5, 3, generator=g), torch.randint(0, 3, (5,), generator=g)


def _desc(*names):
    shapes = {"a": ["n", 2], "b": ["n", 3], "label": ["n"]}
    return {"inputs": [(n, shapes[n]) for n in names], "outputs": [("loss", [], True)]}


def test_inputs_bind_to_forward_by_name_with_loss_fn():
    a, b, label = _batch()
    model = AB()
    expected = ce(model(a, b), label)
    trainer = sgd_trainer(AB(), _desc("b", "a", "label"), debug={"check_model_export": True})
    got = trainer.train_step(b, a, label)  # model_desc order: b first
    torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)
    # keyword call and eval_step bind the same way
    trainer2 = sgd_trainer(AB(), _desc("b", "a", "label"))
    torch.testing.assert_close(trainer2.eval_step(label=label, a=a, b=b), expected.detach(), rtol=1e-5, atol=1e-6)


def test_inputs_bind_by_name_when_the_model_returns_the_loss():
    a, b, label = _batch()
    expected = ABLoss()(a, b, label)
    trainer = sgd_trainer(ABLoss(), _desc("label", "b", "a"), loss_fn=None)
    torch.testing.assert_close(trainer.train_step(label, b, a), expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_name_that_matches_no_parameter_of_forward_is_an_error():
    desc = {"inputs": [("x", ["n", 2]), ("b", ["n", 3]), ("label", ["n"])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match=r"model_desc input 'x' matches no parameter of AB.forward\(a, b\)"):
        sgd_trainer(AB(), desc)


def test_a_required_parameter_without_an_input_is_an_error():
    desc = {"inputs": [("a", ["n", 2]), ("label", ["n"])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match=r"AB.forward\(\) parameter 'b' has no default and no model_desc input"):
        sgd_trainer(AB(), desc)


def test_var_positional_forward_keeps_model_desc_order():
    a, b, label = _batch()
    expected = ce(AB()(a, b), label)
    trainer = sgd_trainer(Star(), _desc("a", "b", "label"))  # forward(*inputs): positions are all there is
    torch.testing.assert_close(trainer.train_step(a, b, label), expected.detach(), rtol=1e-5, atol=1e-6)


def test_var_keyword_forward_receives_extra_names_as_keywords():
    a, b, label = _batch()
    expected = ce(AB()(a, b), label)
    trainer = sgd_trainer(Keywords(), _desc("b", "a", "label"))
    torch.testing.assert_close(trainer.train_step(b, a, label), expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_single_input_reaches_forward_whatever_its_name():
    """nn.Sequential.forward(input) with model_desc input 'x': one input has no order to mix up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    a, _, label = _batch()
    expected = ce(model(a), label)
    desc = {"inputs": [("x", ["n", 2]), ("label", ["n"])], "outputs": [("loss", [], True)]}
    torch.testing.assert_close(sgd_trainer(model, desc).train_step(a, label), expected.detach(), rtol=1e-5, atol=1e-6)
