"""Bad inputs get a ValueError/TypeError naming the input, what was expected and what came (never raw torch/ORT)."""

from __future__ import annotations

import logging

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.builders import mlp_trainer
from tests.models import MLP, MLP_DESC, mlp_batches

ce = torch.nn.functional.cross_entropy


def _trainer(model=None, desc=MLP_DESC, loss_fn=ce):
    return mlp_trainer(model, config=optim.SGDConfig(lr=0.1), desc=desc, loss_fn=loss_fn)


def _built(model=None, desc=MLP_DESC, loss_fn=ce):
    trainer = _trainer(model, desc, loss_fn)
    trainer.train_step(*mlp_batches(1)[0])
    return trainer


X, LABEL = mlp_batches(1)[0]


def test_wrong_float_dtype_before_the_first_step():
    with pytest.raises(
        TypeError, match=r"input 'x' has dtype torch.float64, but the model's parameters are torch.float32"
    ):
        _trainer().train_step(X.double(), LABEL)


def test_float_label_for_cross_entropy():
    pattern = r"input 'label' has dtype torch.float32 .* cross_entropy expects integer class indices \(torch.int64\)"
    with pytest.raises(TypeError, match=pattern):
        _trainer().train_step(X, LABEL.float())
    with pytest.raises(TypeError, match=r"input 'label' must have dtype torch.int64, got torch.float32"):
        _built().train_step(X, LABEL.float())


def test_float_label_for_cross_entropy_logs_no_torch_traceback(caplog):
    """Tracing with fake tensors fails on the float label; torch logs that failure with its traceback at ERROR
    (torch._subclasses.fake_tensor, 15 lines on stderr) before raising it. Our TypeError says it all."""
    with pytest.raises(TypeError, match=r"input 'label' has dtype torch.float32 .* integer class indices"):
        _trainer().train_step(X, LABEL.float())
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert not logged, logged


def test_label_index_out_of_range_on_the_first_and_later_steps():
    pattern = (
        r"input 'label' holds class indices \[7\] out of range: the model predicts 4 classes, so a label must be in "
    )
    pattern += r"\[0, 3\]"
    bad = LABEL.clone()
    bad[0] = 7
    with pytest.raises(ValueError, match=pattern):
        _trainer().train_step(X, bad)
    trainer = _built()
    with pytest.raises(ValueError, match=pattern):
        trainer.train_step(X, bad)
    with pytest.raises(ValueError, match=pattern):
        trainer.eval_step(X, bad)
    assert trainer.train_step_info.step == 1  # the bad step did not count


def test_empty_batch():
    pattern = r"input 'x' is empty \(shape \[0, 20\]\); expected at least one element"
    with pytest.raises(ValueError, match=pattern):
        _trainer().train_step(X[:0], LABEL[:0])
    with pytest.raises(ValueError, match=pattern):
        _built().train_step(X[:0], LABEL[:0])


def test_meta_device_tensor():
    with pytest.raises(
        ValueError, match=r"input 'x' is on the meta device \(a tensor without data\); expected a tensor"
    ):
        _trainer().train_step(X.to("meta"), LABEL)


def test_loss_fn_returning_a_non_scalar():
    per_sample = lambda prediction, label: ce(prediction, label, reduction="none")  # noqa: E731
    with pytest.raises(ValueError, match=r"loss_fn returned a loss of shape \[8\]; the loss must be a scalar"):
        _trainer(loss_fn=per_sample).train_step(X, LABEL)
    with pytest.raises(TypeError, match=r"loss_fn must return the loss as a torch.Tensor, got float"):
        _trainer(loss_fn=lambda prediction, label: 1.0).train_step(X, LABEL)


class DictModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, label):
        logits = self.mlp(x)
        return {"logits": logits, "loss": ce(logits, label)}


def _dict_desc(*outputs):
    return {"inputs": MLP_DESC["inputs"], "outputs": list(outputs)}


def test_forward_returning_a_dict_is_read_by_output_name():
    torch.manual_seed(0)
    model = DictModel()
    expected = model(X, LABEL)
    trainer = ORTTrainer(model, _dict_desc(("logits", ["batch", 4]), ("loss", [], True)), optim.SGDConfig(lr=0.1))
    logits, loss = trainer.eval_step(X, LABEL)
    torch.testing.assert_close(logits, expected["logits"].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected["loss"].detach(), rtol=1e-5, atol=1e-6)
    missing = ORTTrainer(DictModel(), _dict_desc(("loss", [], True), ("probs", ["batch", 4])), optim.SGDConfig(lr=0.1))
    with pytest.raises(ValueError, match=r"DictModel.forward\(\) returned a dict without the key\(s\) \['probs'\]"):
        missing.train_step(X, LABEL)


def test_load_state_dict_refuses_float64_weights_into_a_float32_model():
    weights = {name: value.double() for name, value in MLP().state_dict().items()}
    pattern = r"state_dict\[model\]\[full_precision\]\[fc1.weight\] has dtype torch.float64, but the model's weight "
    pattern += "is torch.float32"
    with pytest.raises(TypeError, match=pattern):
        _trainer().load_state_dict(weights)  # before the first step
    trainer = _built()
    before = trainer.state_dict(pytorch_format=True)
    with pytest.raises(TypeError, match=pattern):
        trainer.load_state_dict(weights)
    for name, value in trainer.state_dict(pytorch_format=True).items():  # nothing was loaded
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    trainer.load_state_dict({name: value.float() for name, value in weights.items()})  # converted: accepted
