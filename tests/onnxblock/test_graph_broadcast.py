"""Broadcast-add of a sliced position table (BERT-style embeddings) gets its full gradient.

ONNX Runtime's gradient builder decides which axes of a broadcast input to sum over from the shapes it
infers. ``position_ids[:, :seq]`` (a slice of a buffer, as Hugging Face BERT/RoBERTa write it) comes out
with two unknown dimensions, which the builder took to be equal to the batch dimension it is added to:
the position table's gradient held only the first sequence's part (without the CPU graph rewrites) or
GatherNDGrad read past the gradient buffer and aborted the process (with them). `_gradient_fixes` keeps
such dims unknown; these tests hold the trainer, with the speed rewrites on, to PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph.onnxblock.rewrites import apply_forward_rewrites
from tests.hf_tiny import HF_CLASSIFIER_DESC, BertClassifier, classifier_batch
from tests.models import LM_DESC, lm_batches, lm_loss
from tests.onnxblock.graph_compare import assert_close, ort_loss_and_grads, torch_loss_and_grads

ce = torch.nn.functional.cross_entropy


class SlicedPositions(torch.nn.Module):
    """Token + position embeddings, position ids sliced from a buffer to the input's length."""

    def __init__(self, vocab: int = 40, d_model: int = 8, max_len: int = 16):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, d_model)
        self.positions = torch.nn.Embedding(max_len, d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("position_ids", torch.arange(max_len)[None], persistent=False)

    def forward(self, tokens):
        positions = self.position_ids[:, : tokens.shape[1]]
        return self.head(self.tokens(tokens) + self.positions(positions))


@pytest.mark.parametrize("rewrite", [None, apply_forward_rewrites])
def test_gradients_match_torch_with_and_without_the_rewrites(rewrite):
    torch.manual_seed(0)
    model = SlicedPositions()
    batch = lm_batches(1, batch=3, seq=6, vocab=40)[0]
    loss, grads, _ = ort_loss_and_grads(model, lm_loss, LM_DESC, batch, rewrite)
    assert_close((loss, grads), torch_loss_and_grads(model, lm_loss, batch))


def _train_like_torch(model, desc, loss_fn, batches):
    trainer = ORTTrainer(copy.deepcopy(model), desc, optim.SGDConfig(lr=0.5), loss_fn=loss_fn)
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for *inputs, label in batches:
        loss = trainer.train_step(*inputs, label)
        sgd.zero_grad()
        expected = loss_fn(reference(*inputs), label)
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    got = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_trainer_updates_the_position_table_like_torch():
    torch.manual_seed(0)
    _train_like_torch(SlicedPositions(), LM_DESC, lm_loss, lm_batches(2, batch=3, seq=6, vocab=40))


def test_hugging_face_bert_trains_like_torch():
    """BertForSequenceClassification slices its position ids from a buffer: the case that aborted."""
    torch.manual_seed(0)
    _train_like_torch(BertClassifier(), HF_CLASSIFIER_DESC, ce, [classifier_batch(seed=s) for s in range(2)])
