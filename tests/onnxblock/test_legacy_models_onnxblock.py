"""Legacy behaviours of the onnxblock engine: its training-graph dump, the TorchScript export of a module that
cannot be deep-copied, and ``_internal_use.extra_postprocess`` (the rest: tests/trainer/test_legacy_models.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import onnx
import pytest
import torch

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
