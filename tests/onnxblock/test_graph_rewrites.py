"""`ort_trainer.graph` speed rewrites: the rewritten graph's loss and gradients equal PyTorch's."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_trainer.config.model_desc import validate_model_desc
from ort_trainer.graph._weightless import checkable
from ort_trainer.graph.onnxblock._export import export_torch_model
from ort_trainer.graph.onnxblock._passes import add_optional_outputs
from ort_trainer.graph.onnxblock.rewrites import apply_forward_rewrites as apply_rewrites
from ort_trainer.graph.onnxblock.rewrites import decompose_softmax_cross_entropy, gather_to_gather_nd
from tests.models import LM_DESC, MLP, MLP_DESC, TinyLM, lm_batches, lm_loss, mlp_batches
from tests.onnxblock.graph_compare import assert_close, ort_loss_and_grads, torch_loss_and_grads

ce = torch.nn.functional.cross_entropy


@pytest.mark.parametrize("ignored", [False, True])
def test_transformer_lm_gradients_match_torch(ignored):
    torch.manual_seed(0)
    model = TinyLM(vocab=64, d_model=16, layers=2, heads=2)
    tokens, label = lm_batches(1, batch=3, seq=10, vocab=64)[0]
    if ignored:  # torch's ignore_index=-100 is exported as an attribute of SoftmaxCrossEntropyLoss
        label[0, :4] = -100
    batch = (tokens, label)
    loss, grads, changed = ort_loss_and_grads(model, lm_loss, LM_DESC, batch, apply_rewrites)
    # the embedding, q/k/v of both layers' packed in-projection, and the loss
    assert changed == 1 + 3 * 2 + 1
    assert_close((loss, grads), torch_loss_and_grads(model, lm_loss, batch))


def test_rewritten_graph_has_no_gather_grad_or_softmax_cross_entropy():
    torch.manual_seed(0)
    model = TinyLM(vocab=32, d_model=8, layers=1, heads=2)
    batch = lm_batches(1, batch=2, seq=6, vocab=32)[0]
    desc = validate_model_desc(LM_DESC, require_loss=True)
    forward = export_torch_model(model, lm_loss, desc, batch, 17).model
    apply_rewrites(forward)
    add_optional_outputs(forward)
    ops = {node.op_type for node in forward.graph.node}
    assert "SoftmaxCrossEntropyLoss" not in ops and "ReduceMax" in ops
    float_gathers = [n for n in forward.graph.node if n.op_type == "Gather" and "embed" in n.input[0]]
    assert not float_gathers
    assert [o.name for o in forward.graph.output] == ["loss"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_reductions_match_torch(reduction):
    def loss_fn(logits, label):
        loss = ce(logits, label, reduction=reduction)
        return loss.mean() if reduction == "none" else loss

    torch.manual_seed(1)
    model = MLP()
    batch = mlp_batches(1, batch=8)[0]
    loss, grads, changed = ort_loss_and_grads(model, loss_fn, MLP_DESC, batch, decompose_softmax_cross_entropy)
    assert changed == 1
    assert_close((loss, grads), torch_loss_and_grads(model, loss_fn, batch))


def test_cross_entropy_with_class_axis_one_of_three():
    """(N, C, d) scores, as cross_entropy(logits.transpose(1, 2), label) exports them."""

    def loss_fn(logits, label):
        return ce(logits.transpose(1, 2), label)

    torch.manual_seed(2)
    model = TinyLM(vocab=40, d_model=8, layers=1, heads=2)
    batch = lm_batches(1, batch=2, seq=5, vocab=40)[0]
    loss, grads, changed = ort_loss_and_grads(model, loss_fn, LM_DESC, batch, apply_rewrites)
    assert changed == 1 + 3 + 1
    assert_close((loss, grads), torch_loss_and_grads(model, loss_fn, batch))


def test_class_weights_are_left_alone():
    weight = torch.linspace(0.5, 2.0, 4)

    def loss_fn(logits, label):
        return ce(logits, label, weight=weight)

    torch.manual_seed(3)
    model = MLP()
    batch = mlp_batches(1, batch=8)[0]
    loss, grads, changed = ort_loss_and_grads(model, loss_fn, MLP_DESC, batch, decompose_softmax_cross_entropy)
    assert changed == 0
    assert_close((loss, grads), torch_loss_and_grads(model, loss_fn, batch))


class _Int32Embedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 6)
        self.head = torch.nn.Linear(6, 30)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def test_int32_indices_get_a_cast():
    torch.manual_seed(4)
    model = _Int32Embedding()
    tokens, label = lm_batches(1, batch=2, seq=7, vocab=30)[0]
    batch = (tokens.to(torch.int32), label)
    loss, grads, changed = ort_loss_and_grads(model, lm_loss, LM_DESC, batch, gather_to_gather_nd)
    assert changed == 1
    assert_close((loss, grads), torch_loss_and_grads(model, lm_loss, batch))


def test_non_float_and_non_zero_axis_gathers_are_left_alone():
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Shape", ["x"], ["shape"]),
            onnx.helper.make_node("Gather", ["shape", "i"], ["dim"], axis=0),
            onnx.helper.make_node("Gather", ["x", "j"], ["column"], axis=1),
        ],
        "g",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4]),
            onnx.helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            onnx.helper.make_tensor_value_info("j", onnx.TensorProto.INT64, [2]),
        ],
        [
            onnx.helper.make_tensor_value_info("dim", onnx.TensorProto.INT64, []),
            onnx.helper.make_tensor_value_info("column", onnx.TensorProto.FLOAT, [3, 2]),
        ],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert gather_to_gather_nd(model) == 0
    assert model.SerializeToString() == before


def test_large_logits_stay_finite_and_match_torch():
    def loss_fn(logits, label):
        return ce(logits * 1000.0, label)  # logit gaps of thousands: exp() would overflow without the shift

    torch.manual_seed(5)
    model = MLP()
    batch = mlp_batches(1, batch=8)[0]
    loss, grads, changed = ort_loss_and_grads(model, loss_fn, MLP_DESC, batch, decompose_softmax_cross_entropy)
    assert changed == 1
    assert_close((loss, grads), torch_loss_and_grads(model, loss_fn, batch))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_forward_outputs_including_log_prob_are_unchanged(reduction):
    """Hand-built graph whose log_prob output is returned; labels include the ignore_index."""
    tensor = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node(
                "SoftmaxCrossEntropyLoss",
                ["scores", "label"],
                ["loss", "log_prob"],
                reduction=reduction,
                ignore_index=2,
            )
        ],
        "g",
        [tensor("scores", onnx.TensorProto.FLOAT, [6, 5]), tensor("label", onnx.TensorProto.INT64, [6])],
        [
            tensor("loss", onnx.TensorProto.FLOAT, [6] if reduction == "none" else []),
            tensor("log_prob", onnx.TensorProto.FLOAT, [6, 5]),
        ],
    )
    original = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    rewritten = copy.deepcopy(original)
    assert decompose_softmax_cross_entropy(rewritten) == 1
    onnx.checker.check_model(checkable(rewritten))
    rng = np.random.default_rng(0)
    feeds = {"scores": (rng.standard_normal((6, 5)) * 30).astype(np.float32), "label": np.array([0, 2, 4, 1, 2, 3])}
    run = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        for m in (original, rewritten)
    ]
    for expected, got in zip(*run, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
