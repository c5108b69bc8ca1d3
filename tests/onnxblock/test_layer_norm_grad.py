"""`decompose_layer_norm_grads`: element-wise LayerNorm gradients equal ORT's kernel and PyTorch's autograd."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer.graph.onnxblock.rewrites import (
    apply_forward_rewrites,
    apply_training_rewrites,
    decompose_layer_norm_grads,
)
from tests.hf_tiny import GPT2, HF_CLASSIFIER_DESC, HF_DESC, BertClassifier, classifier_batch, lm_batch, token_loss
from tests.models import LM_DESC, TinyLM, lm_batches, lm_loss
from tests.onnxblock.graph_compare import assert_close, ort_loss_and_grads, torch_loss_and_grads

ce = torch.nn.functional.cross_entropy


def _grad_model(shape: list[int], outputs: list[str], opset: int) -> onnx.ModelProto:
    stats = [*shape[:-1], 1]
    inputs = [("dy", shape), ("x", shape), ("scale", shape[-1:]), ("mean", stats), ("inv_std", stats)]
    node = helper.make_node(
        "LayerNormalizationGrad", [n for n, _ in inputs], outputs, domain="com.microsoft", axis=-1, epsilon=1e-5
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs if n],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("shape", [[6, 32], [2, 5, 48]])
@pytest.mark.parametrize("opset", [12, 17, 18])
@pytest.mark.parametrize("outputs", [["dx", "dscale", "dbias"], ["dx", "dscale", ""], ["", "dscale", "dbias"]])
def test_decomposition_equals_the_kernel(shape, opset, outputs):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    mean = x.mean(-1, keepdims=True)
    inv_std = (1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)).astype(np.float32)
    feeds = {"dy": rng.standard_normal(shape).astype(np.float32), "x": x, "mean": mean, "inv_std": inv_std}
    feeds["scale"] = rng.standard_normal(shape[-1:]).astype(np.float32)
    original = _grad_model(shape, ["dx", "dscale", "dbias"], opset)  # the kernel takes all three outputs
    rewritten = _grad_model(shape, outputs, opset)  # unused outputs ("") are not computed
    assert decompose_layer_norm_grads(rewritten) == 1
    assert "LayerNormalizationGrad" not in {node.op_type for node in rewritten.graph.node}
    expected_all = dict(zip(["dx", "dscale", "dbias"], _run(original, feeds), strict=True))
    for name, got in zip([n for n in outputs if n], _run(rewritten, feeds), strict=True):
        expected = expected_all[name]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_other_axes_are_left_alone():
    model = _grad_model([2, 5, 48], ["dx", "dscale", "dbias"], 17)
    next(a for a in model.graph.node[0].attribute if a.name == "axis").i = 1  # normalize over the last two axes
    assert decompose_layer_norm_grads(model) == 0


def _count_and_rewrite(replaced: list):
    def train_rewrite(model):
        replaced.append(decompose_layer_norm_grads(model))
        return replaced[-1]

    return train_rewrite


def test_transformer_lm_gradients_match_torch():
    torch.manual_seed(0)
    model = TinyLM(vocab=64, d_model=16, layers=2, heads=2)
    batch = lm_batches(1, batch=3, seq=10, vocab=64)[0]
    replaced = []
    result = ort_loss_and_grads(model, lm_loss, LM_DESC, batch, None, _count_and_rewrite(replaced))
    assert replaced == [4]  # two LayerNorms per encoder layer
    assert_close(result[:2], torch_loss_and_grads(model, lm_loss, batch))


def test_hugging_face_gpt2_and_bert_gradients_match_torch_with_every_rewrite():
    torch.manual_seed(0)
    for model, loss_fn, desc, batch, layer_norms in (
        (GPT2(layers=2), token_loss, HF_DESC, lm_batch(), 5),  # ln_1, ln_2 per layer + ln_f
        (BertClassifier(layers=2), ce, HF_CLASSIFIER_DESC, classifier_batch(), 5),  # embeddings + 2 per layer
    ):
        replaced = []

        def train_rewrite(train, replaced=replaced):
            replaced.append(decompose_layer_norm_grads(train))
            return replaced[-1] + apply_training_rewrites(train)

        result = ort_loss_and_grads(model, loss_fn, desc, batch, apply_forward_rewrites, train_rewrite)
        assert replaced == [layer_norms]
        assert_close(result[:2], torch_loss_and_grads(model, loss_fn, batch))
