"""Valid models and settings that the legacy ORTTrainer trained, and that we must train (or refuse in clear words)."""

from __future__ import annotations

import pytest
import torch

from ort_trainer.config.model_desc import InputDescription, InputDescriptionTyped, OutputDescriptionTyped
from tests.builders import sgd_trainer
from tests.models import MLP, mlp_batches

ce = torch.nn.functional.cross_entropy


class IgnoresY(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, y):
        return self.mlp(x)


def test_a_model_desc_input_that_forward_ignores_is_accepted_with_a_warning():
    desc = {
        "inputs": [("x", ["batch", 20]), ("y", ["batch", 3]), ("label", ["batch"])],
        "outputs": [("loss", [], True)],
    }
    torch.manual_seed(0)
    model = IgnoresY()
    reference = ce(model(*mlp_batches(1)[0][:1], None), mlp_batches(1)[0][1])
    trainer = sgd_trainer(model, desc)
    (x, label), y = mlp_batches(1)[0], torch.zeros(8, 3)
    with pytest.warns(UserWarning, match=r"model_desc inputs \['y'\] are not used by the model"):
        loss = trainer.train_step(x, y, label)
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
    trainer.train_step(x, y, label)
    trainer.eval_step(x=x, y=y, label=label)


class NoParameters(torch.nn.Module):
    def forward(self, x):
        return x[:, :4] * 2


class OnlyFrozen(MLP):
    def __init__(self):
        super().__init__()
        for p in self.parameters():
            p.requires_grad_(False)


def test_nothing_to_train_says_why():
    x, label = mlp_batches(1)[0]
    with pytest.raises(ValueError, match="the model has no parameters: there is nothing to train") as info:
        sgd_trainer(NoParameters()).train_step(x, label)
    assert "frozen_weights" not in str(info.value)
    with pytest.raises(ValueError, match=r"none of the model's parameters requires a gradient: .*requires_grad=False"):
        sgd_trainer(OnlyFrozen()).train_step(x, label)
    with pytest.raises(ValueError, match=r"no trainable parameters left after applying options.utils.frozen_weights"):
        names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        sgd_trainer(MLP(), utils={"frozen_weights": names}).train_step(x, label)


@pytest.mark.parametrize(
    "option", ["model_with_gradient_graph_path", "model_with_training_graph_after_optimization_path"]
)
def test_graph_save_paths_are_checked_when_the_trainer_is_built(tmp_path, option):
    with pytest.raises(ValueError, match=rf"debug.graph_save_paths.{option}=.* is a directory"):
        sgd_trainer(MLP(), debug={"graph_save_paths": {option: str(tmp_path)}})
    with pytest.raises(ValueError, match=rf"debug.graph_save_paths.{option}=.*: folder .*missing.* does not exist"):
        sgd_trainer(MLP(), debug={"graph_save_paths": {option: str(tmp_path / "missing" / "g.onnx")}})


def test_model_desc_entries_are_the_legacy_namedtuples():
    trainer = sgd_trainer(MLP())
    name, shape = trainer.model_desc.inputs[0]  # before the first step: (name, shape)
    assert (name, shape) == ("x", ["batch", 20]) and isinstance(trainer.model_desc.inputs[0], InputDescription)
    trainer.train_step(*mlp_batches(1)[0])
    x, label = trainer.model_desc.inputs
    assert x == ("x", ["batch", 20], torch.float32) and isinstance(x, InputDescriptionTyped)
    assert label[0] == "label" and label[1] == ["batch"] and label[2] == torch.int64 and label.dtype == torch.int64
    assert trainer.model_desc.outputs[0] == OutputDescriptionTyped("loss", [], True, torch.float32, None)
    name, shape, is_loss, dtype, dtype_amp = trainer.model_desc.outputs[0]
    assert isinstance(shape, list) and is_loss and dtype == torch.float32 and dtype_amp is None


def test_a_single_list_of_inputs_is_unpacked_like_legacy():
    torch.manual_seed(0)
    model = MLP()
    x, label = mlp_batches(1)[0]
    expected = ce(model(x), label)
    trainer = sgd_trainer(model)
    torch.testing.assert_close(trainer.train_step([x, label]), expected.detach(), rtol=1e-5, atol=1e-6)
    trainer.eval_step([x, label])
