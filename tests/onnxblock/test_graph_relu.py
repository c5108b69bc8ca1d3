"""`decompose_relu_grads`: dY * Cast(Y > 0) equals ORT's ReluGrad kernel and PyTorch's autograd."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ort_trainer.graph._weightless import checkable
from ort_trainer.graph.onnxblock.rewrites import apply_forward_rewrites, decompose_relu_grads
from tests.models import LM_DESC, MLP, MLP_DESC, TinyLM, lm_batches, lm_loss, mlp_batches
from tests.onnxblock.graph_compare import assert_close, ort_loss_and_grads, torch_loss_and_grads

ce = torch.nn.functional.cross_entropy


def _relu_grad_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("ReluGrad", ["dy", "y"], ["dx"], domain="com.microsoft")],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 50]) for n in ("dy", "y")],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [4, 50])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_decomposition_equals_the_kernel_bit_for_bit():
    rng = np.random.default_rng(0)
    y = np.maximum(rng.standard_normal((4, 50)), 0).astype(np.float32)  # a ReLU output: zeros and positives
    y[0, :5] = [0.0, -0.0, 1e-30, np.inf, np.nan]
    feeds = {"dy": rng.standard_normal((4, 50)).astype(np.float32), "y": y}
    original, rewritten = _relu_grad_model(), _relu_grad_model()
    assert decompose_relu_grads(rewritten) == 1
    assert "ReluGrad" not in {node.op_type for node in rewritten.graph.node}
    onnx.checker.check_model(checkable(rewritten))
    np.testing.assert_array_equal(_run(rewritten, feeds), _run(original, feeds))


def test_mlp_gradients_match_torch():
    torch.manual_seed(0)
    model = MLP()
    batch = mlp_batches(1, batch=8)[0]
    loss, grads, changed = ort_loss_and_grads(model, ce, MLP_DESC, batch, None, decompose_relu_grads)
    assert changed == 1
    assert_close((loss, grads), torch_loss_and_grads(model, ce, batch))


def test_transformer_lm_gradients_match_torch_with_every_rewrite():
    torch.manual_seed(0)
    model = TinyLM(vocab=64, d_model=16, layers=2, heads=2)
    batch = lm_batches(1, batch=3, seq=10, vocab=64)[0]
    replaced = []

    def train_rewrite(train):
        replaced.append(decompose_relu_grads(train))
        return replaced[-1]

    loss, grads, _ = ort_loss_and_grads(model, lm_loss, LM_DESC, batch, apply_forward_rewrites, train_rewrite)
    assert replaced == [2]  # one per encoder layer's feed-forward ReLU
    assert_close((loss, grads), torch_loss_and_grads(model, lm_loss, batch))
