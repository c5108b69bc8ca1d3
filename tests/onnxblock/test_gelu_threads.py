"""On one ORT thread the exact GELU gradient kernel stays (faster than its element-wise form there); tanh goes."""

from __future__ import annotations

import torch

from ort_trainer.graph.onnxblock.rewrites import apply_forward_rewrites, apply_training_rewrites
from tests.hf_tiny import GPT2, HF_CLASSIFIER_DESC, HF_DESC, BertClassifier, classifier_batch, lm_batch, token_loss
from tests.onnxblock.graph_compare import assert_close, ort_loss_and_grads, torch_loss_and_grads

ce = torch.nn.functional.cross_entropy


def _ops_after(model, loss_fn, desc, batch, threads):
    seen = []

    def train_rewrite(train):
        changed = apply_training_rewrites(train, threads)
        seen.append({node.op_type for node in train.graph.node})
        return changed

    result = ort_loss_and_grads(model, loss_fn, desc, batch, apply_forward_rewrites, train_rewrite)
    assert_close(result[:2], torch_loss_and_grads(model, loss_fn, batch))
    return seen[0]


def test_bert_keeps_the_exact_gelu_kernel_on_one_thread_only():
    torch.manual_seed(0)
    model, batch = BertClassifier(layers=2), classifier_batch()
    assert "BiasGeluGrad_dX" in _ops_after(model, ce, HF_CLASSIFIER_DESC, batch, threads=1)
    assert "BiasGeluGrad_dX" not in _ops_after(model, ce, HF_CLASSIFIER_DESC, batch, threads=2)


def test_gpt2_tanh_gelu_gradient_is_decomposed_on_one_thread_too():
    torch.manual_seed(0)
    ops = _ops_after(GPT2(layers=2), token_loss, HF_DESC, lm_batch(), threads=1)
    assert not {"FastGeluGrad", "BiasFastGeluGrad_dX"} & ops
