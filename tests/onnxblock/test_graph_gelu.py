"""`decompose_gelu_grads`: element-wise GELU gradients equal ORT's fused kernels and PyTorch's autograd."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph._weightless import checkable
from ort_trainer.graph.onnxblock.rewrites import apply_forward_rewrites, decompose_gelu_grads
from tests.hf_tiny import GPT2, HF_CLASSIFIER_DESC, HF_DESC, BertClassifier, classifier_batch, lm_batch, token_loss
from tests.models import MLP_DESC, mlp_batches
from tests.onnxblock.graph_compare import assert_close, ort_loss_and_grads, torch_loss_and_grads

ce = torch.nn.functional.cross_entropy


def _kernel_model(op_type: str, inputs: list[str]) -> onnx.ModelProto:
    shapes = {"dy": [3, 97], "x": [3, 97], "bias": [97]}
    graph = helper.make_graph(
        [helper.make_node(op_type, inputs, ["dx"], domain="com.microsoft")],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in inputs],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3, 97])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("op_type", ["GeluGrad", "BiasGeluGrad_dX", "FastGeluGrad", "BiasFastGeluGrad_dX"])
def test_decomposition_equals_the_fused_kernel(op_type):
    inputs = ["dy", "x", "bias"] if op_type.startswith("Bias") else ["dy", "x"]
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-12, 12, 97), rng.standard_normal(3 * 97 - 97) * 3]).astype(np.float32)
    feeds = {"dy": rng.standard_normal((3, 97)).astype(np.float32), "x": x.reshape(3, 97)}
    feeds["bias"] = rng.standard_normal(97).astype(np.float32)
    feeds = {name: feeds[name] for name in inputs}
    original, rewritten = _kernel_model(op_type, inputs), _kernel_model(op_type, inputs)
    assert decompose_gelu_grads(rewritten) == 1
    assert op_type not in {node.op_type for node in rewritten.graph.node}
    onnx.checker.check_model(checkable(rewritten))
    expected = _run(original, feeds)
    np.testing.assert_allclose(_run(rewritten, feeds), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_graphs_without_gelu_gradients_are_left_alone():
    model = _kernel_model("TanhGrad", ["dy", "x"])
    before = model.SerializeToString()
    assert decompose_gelu_grads(model) == 0
    assert model.SerializeToString() == before


class _GeluMLP(torch.nn.Module):
    def __init__(self, approximate: str):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(20, 32), torch.nn.Linear(32, 4)
        self.act = torch.nn.GELU(approximate=approximate)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_gelu_gradients_match_torch(approximate):
    """nn.GELU() becomes Gelu + GeluGrad; nn.GELU("tanh") exports to ops ORT does not fuse (nothing to do)."""
    torch.manual_seed(0)
    model = _GeluMLP(approximate)
    batch = mlp_batches(1, batch=8)[0]
    loss, grads, changed = ort_loss_and_grads(model, ce, MLP_DESC, batch, None, decompose_gelu_grads)
    assert changed == (1 if approximate == "none" else 0)
    assert_close((loss, grads), torch_loss_and_grads(model, ce, batch))


def test_hugging_face_gpt2_gradients_match_torch():
    """GPT-2's NewGELUActivation becomes FastGelu + FastGeluGrad; with every rewrite on."""
    torch.manual_seed(0)
    model = GPT2(layers=2)
    batch = lm_batch()
    replaced = []

    def train_rewrite(model):
        replaced.append(decompose_gelu_grads(model))
        return replaced[-1]

    loss, grads, _ = ort_loss_and_grads(model, token_loss, HF_DESC, batch, apply_forward_rewrites, train_rewrite)
    assert replaced == [2]  # one FastGeluGrad per layer
    assert_close((loss, grads), torch_loss_and_grads(model, token_loss, batch))


def test_hugging_face_bert_gradients_match_torch():
    """BERT's exact GELU becomes BiasGelu + BiasGeluGrad_dX."""
    torch.manual_seed(0)
    model = BertClassifier(layers=2)
    batch = classifier_batch()
    replaced = []

    def train_rewrite(model):
        replaced.append(decompose_gelu_grads(model))
        return replaced[-1]

    loss, grads, _ = ort_loss_and_grads(model, ce, HF_CLASSIFIER_DESC, batch, apply_forward_rewrites, train_rewrite)
    assert replaced == [2]  # one BiasGeluGrad_dX per layer
    assert_close((loss, grads), torch_loss_and_grads(model, ce, batch))


def test_hugging_face_bert_trains_like_torch_with_adamw():
    """ORTTrainer end to end on BERT (sliced position ids, exact BiasGelu, padding mask), 3 AdamW steps."""
    torch.manual_seed(0)
    model = BertClassifier(layers=2)
    batches = [classifier_batch(seed=s) for s in range(3)]
    config = optim.AdamConfig(lr=1e-3, epsilon=1e-6)
    trainer = ORTTrainer(
        copy.deepcopy(model), HF_CLASSIFIER_DESC, config, loss_fn=ce, options={"utils": {"grad_norm_clip": False}}
    )
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    for *inputs, label in batches:
        loss = trainer.train_step(*inputs, label)
        adamw.zero_grad()
        expected = ce(reference(*inputs), label)
        expected.backward()
        adamw.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    got = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=f"{name} differs")
