"""ORTTrainer's public surface: constructor checks, inputs, frozen weights, ONNX models, export, fetches."""

from __future__ import annotations

import copy
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.builders import mlp_trainer
from tests.models import CNN, CNN_DESC, MLP, MLP_DESC, cnn_batches, mlp_batches

ce = torch.nn.functional.cross_entropy


def test_constructor_rejects_wrong_types():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or an onnx.ModelProto, got str"):
        ORTTrainer("model.onnx", MLP_DESC, optim.AdamConfig())
    with pytest.raises(TypeError, match="optim_config must be an optim.AdamConfig.*got dict"):
        ORTTrainer(MLP(), MLP_DESC, {"lr": 0.1})
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=3)


def test_constructor_validates_model_desc_and_options():
    with pytest.raises(ValueError, match="Invalid model_desc"):
        ORTTrainer(MLP(), {"inputs": [("x", ["batch", 20])], "outputs": [("loss", [], False)]}, optim.AdamConfig())
    with pytest.raises(ValueError, match="batchz"):
        ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=ce, options={"batchz": {}})
    with pytest.raises(NotImplementedError, match="enable_adasum"):
        ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=ce, options={"distributed": {"enable_adasum": True}})


def test_cuda_device_without_cuda_provider_is_a_clear_error():
    if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=ce, options={"device": {"id": "cuda:0"}})


def test_inputs_are_checked_against_model_desc():
    trainer = mlp_trainer()
    x, label = mlp_batches(1)[0]
    with pytest.raises(ValueError, match="missing inputs \\['label'\\]"):
        trainer.train_step(x)
    with pytest.raises(ValueError, match="x"):
        trainer.train_step(torch.randn(8, 21), label)  # fixed dim 20
    with pytest.raises(ValueError, match="batch"):
        trainer.train_step(torch.randn(8, 20), label[:4])  # 'batch' differs between inputs
    with pytest.raises(TypeError, match="label"):
        trainer.train_step(x, [1, 2])
    trainer.train_step(x, label)
    with pytest.raises(TypeError, match="input 'label' must have dtype torch.int64, got torch.int32"):
        trainer.train_step(x, label.int())
    # named inputs work and count the same as positional ones
    trainer.train_step(x=x, label=label)
    assert trainer.train_step_info.step == 2


def test_train_step_returns_loss_before_update_and_fetches_select_outputs():
    torch.manual_seed(0)
    desc = {"inputs": MLP_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", 4])]}
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.5), loss_fn=ce)
    x, label = mlp_batches(1)[0]
    loss, logits = trainer.train_step(x, label)
    torch.testing.assert_close(logits, reference(x).detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, ce(reference(x), label).detach(), atol=1e-6, rtol=1e-5)
    trainer.train_step_info.fetches = ["logits"]
    assert trainer.train_step(x, label).shape == (8, 4)
    trainer.train_step_info.fetches = ["nope"]
    with pytest.raises(ValueError, match="fetches \\['nope'\\] are not outputs"):
        trainer.eval_step(x, label)


def test_frozen_weights_stay_put_and_unknown_names_are_rejected():
    torch.manual_seed(0)
    model = MLP()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ORTTrainer(
        model, MLP_DESC, optim.AdamConfig(lr=0.1), loss_fn=ce, options={"utils": {"frozen_weights": ["fc1.weight"]}}
    )
    for batch in mlp_batches(3):
        trainer.train_step(*batch)
    state = trainer.state_dict(pytorch_format=True)
    torch.testing.assert_close(state["fc1.weight"], initial["fc1.weight"], atol=0, rtol=0)
    assert not torch.equal(state["fc1.bias"], initial["fc1.bias"])
    assert "fc1.weight" not in trainer.state_dict()["optimizer"]

    with pytest.raises(ValueError, match="frozen_weights names \\['fc3.weight'\\], which are not parameters"):
        ORTTrainer(  # checked at construction: the parameters are known from the module
            MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=ce, options={"utils": {"frozen_weights": ["fc3.weight"]}}
        )


def test_requires_grad_false_parameters_are_frozen_like_pytorch():
    torch.manual_seed(0)
    model = MLP()
    model.fc2.bias.requires_grad_(False)
    trainer = ORTTrainer(model, MLP_DESC, optim.AdamConfig(lr=0.1), loss_fn=ce)
    for batch in mlp_batches(3):
        trainer.train_step(*batch)
    torch.testing.assert_close(trainer.state_dict(pytorch_format=True)["fc2.bias"], model.fc2.bias.detach())


def test_eval_step_turns_dropout_off():
    torch.manual_seed(0)

    class DropMLP(MLP):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.fc2(self.drop(torch.relu(self.fc1(x))))

    model = DropMLP()
    trainer = ORTTrainer(model, MLP_DESC, optim.AdamConfig(lr=0.0), loss_fn=ce)
    x, label = mlp_batches(1, batch=64)[0]
    model.eval()
    expected = ce(model(x), label).detach()
    torch.testing.assert_close(trainer.eval_step(x, label), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trainer.eval_step(x, label), expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(trainer.train_step(x, label), expected)  # training mode drops units


def _exported_mlp_with_loss(model):
    class WithLoss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, label):
            return ce(self.m(x), label)

    buffer = io.BytesIO()
    x, label = mlp_batches(1)[0]
    torch.onnx.export(
        WithLoss(copy.deepcopy(model)),
        (x, label),
        buffer,
        input_names=["x", "label"],
        output_names=["loss"],
        dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}},
        opset_version=17,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        dynamo=False,
    )
    return onnx.load_from_string(buffer.getvalue())


def test_onnx_model_trains_like_the_torch_model():
    torch.manual_seed(0)
    model = MLP()
    onnx_model = _exported_mlp_with_loss(model)
    from_onnx = ORTTrainer(onnx_model, MLP_DESC, optim.AdamConfig(lr=0.01))
    from_torch = ORTTrainer(copy.deepcopy(model), MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    for batch in mlp_batches(5):
        torch.testing.assert_close(from_onnx.train_step(*batch), from_torch.train_step(*batch))
    a = from_onnx.state_dict()["model"]["full_precision"]
    b = from_torch.state_dict()["model"]["full_precision"]
    assert {k.removeprefix("m.") for k in a} == set(b)
    for name, value in a.items():
        torch.testing.assert_close(value, b[name.removeprefix("m.")])


def test_onnx_model_checks():
    onnx_model = _exported_mlp_with_loss(MLP())
    with pytest.raises(ValueError, match="loss_fn is not allowed with an ONNX model"):
        ORTTrainer(onnx_model, MLP_DESC, optim.AdamConfig(), loss_fn=ce)
    wrong = {"inputs": [("features", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match="inputs \\['features'\\].*not in the graph"):
        ORTTrainer(onnx_model, wrong, optim.AdamConfig())


def test_save_as_onnx_round_trips_through_plain_inference_session(tmp_path):
    torch.manual_seed(0)
    trainer = ORTTrainer(CNN(), CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    batches = cnn_batches(4)
    with pytest.raises(RuntimeError, match="run one step first"):
        trainer.save_as_onnx(tmp_path / "early.onnx")
    for batch in batches:
        trainer.train_step(*batch)
    path = tmp_path / "trained.onnx"
    trainer.save_as_onnx(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x, label = batches[0]
    (loss,) = session.run(None, {"x": x.numpy(), "label": label.numpy()})
    np.testing.assert_allclose(loss, trainer.eval_step(x, label).numpy(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="is a directory"):
        trainer.save_as_onnx(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        trainer.save_as_onnx(tmp_path / "missing" / "m.onnx")


def test_tied_weights_train_as_one_parameter():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("tokens", ["batch"]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.5), loss_fn=ce)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        tokens, label = torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)
        trainer.train_step(tokens, label)
        opt.zero_grad()
        ce(reference(tokens), label).backward()
        opt.step()
    state = trainer.state_dict(pytorch_format=True)
    assert set(state) == {"embed.weight", "head.weight"}
    torch.testing.assert_close(state["head.weight"], reference.head.weight.detach(), atol=1e-6, rtol=1e-5)
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
