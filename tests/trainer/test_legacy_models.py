"""Valid models and settings that the legacy ORTTrainer trained, and that we must train (or refuse in clear words)."""

from __future__ import annotations

import threading
from pathlib import Path

import onnx
import pytest
import torch

from ort_trainer.config.model_desc import InputDescription, InputDescriptionTyped, OutputDescriptionTyped
from tests.builders import sgd_trainer
from tests.models import CNN, CNN_DESC, MLP, cnn_batches, mlp_batches

ce = torch.nn.functional.cross_entropy
DOCS = Path(__file__).resolve().parents[2] / "docs"


class LockedCNN(CNN):
    """Holds a threading.Lock: copy.deepcopy fails on it."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def test_a_module_that_cannot_be_deep_copied_trains_and_is_left_as_it_was():
    torch.manual_seed(0)
    model = LockedCNN()
    model.fc.eval()  # a mixed train/eval state that the export must not flatten
    reference = CNN()
    reference.load_state_dict(model.state_dict())
    modes = [m.training for m in model.modules()]
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = sgd_trainer(model, CNN_DESC, utils={"share_module_parameters": False})  # the module is left as it was
    x, label = cnn_batches(1)[0]
    with pytest.warns(UserWarning, match=r"LockedCNN cannot be deep-copied \(TypeError: cannot pickle"):
        loss = trainer.train_step(x, label)
    torch.testing.assert_close(loss, ce(reference.train()(x), label).detach(), rtol=1e-5, atol=1e-6)
    assert [m.training for m in model.modules()] == modes
    for name, value in model.state_dict().items():  # BatchNorm statistics untouched by the tracing forward
        torch.testing.assert_close(value, buffers[name], rtol=0, atol=0)


def test_a_module_that_cannot_be_deep_copied_shows_one_training_forward_in_its_statistics():
    torch.manual_seed(0)
    model = LockedCNN()  # default: the module holds the trainer's weights and statistics
    reference = CNN()
    reference.load_state_dict(model.state_dict())
    x, label = cnn_batches(1)[0]
    trainer = sgd_trainer(model, CNN_DESC)
    with pytest.warns(UserWarning, match=r"LockedCNN cannot be deep-copied"):
        trainer.train_step(x, label)
    reference.train()(x)  # one training forward: the statistics move once (the tracing forward must not count)
    for name, value in reference.state_dict().items():
        if "running" in name:
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


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


def test_training_graph_dump_is_the_gradient_graph_and_the_docs_say_so(tmp_path):
    paths = {"model_with_gradient_graph_path": str(tmp_path / "grad.onnx")}
    paths["model_with_training_graph_path"] = str(tmp_path / "train.onnx")
    paths["model_with_training_graph_after_optimization_path"] = str(tmp_path / "optimized.onnx")
    trainer = sgd_trainer(MLP(), debug={"graph_save_paths": paths})
    trainer.train_step(*mlp_batches(1)[0])
    gradient, training = (
        onnx.load(paths["model_with_gradient_graph_path"]),
        onnx.load(paths["model_with_training_graph_path"]),
    )
    assert gradient == training
    ops = {node.op_type for node in training.graph.node}
    assert not ops & {"AdamOptimizer", "AdamWOptimizer", "LambOptimizer", "SGDOptimizer", "SGDOptimizerV2"}
    # the optimized dump is ORT's optimized *training* graph (the eval session used to overwrite it)
    optimized = onnx.load(paths["model_with_training_graph_after_optimization_path"])
    assert "lazy_reset_grad" in {i.name for i in optimized.graph.input}
    migrating = " ".join((DOCS / "migrating.md").read_text().split())
    assert "`model_with_training_graph_path` receives the same graph as `model_with_gradient_graph_path`" in migrating


def test_a_single_list_of_inputs_is_unpacked_like_legacy():
    torch.manual_seed(0)
    model = MLP()
    x, label = mlp_batches(1)[0]
    expected = ce(model(x), label)
    trainer = sgd_trainer(model)
    torch.testing.assert_close(trainer.train_step([x, label]), expected.detach(), rtol=1e-5, atol=1e-6)
    trainer.eval_step([x, label])


def test_extra_postprocess_gets_the_forward_graph_and_its_result_is_used(tmp_path):
    seen = []

    def postprocess(model):
        seen.append(type(model))
        model.graph.doc_string = "post-processed"
        return model

    path = str(tmp_path / "forward.onnx")
    options = {"_internal_use": {"extra_postprocess": postprocess}}
    trainer = sgd_trainer(MLP(), debug={"graph_save_paths": {"model_after_graph_transforms_path": path}}, **options)
    trainer.train_step(*mlp_batches(1)[0])
    assert seen == [onnx.ModelProto] and onnx.load(path).graph.doc_string == "post-processed"
    bad = sgd_trainer(MLP(), _internal_use={"extra_postprocess": lambda model: None})
    with pytest.raises(TypeError, match="extra_postprocess must return an onnx.ModelProto, got NoneType"):
        bad.train_step(*mlp_batches(1)[0])
