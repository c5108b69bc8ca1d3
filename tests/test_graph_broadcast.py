"""Broadcast-add of a sliced position table (BERT-style embeddings) gets its full gradient.

ONNX Runtime's gradient builder decides which axes of a broadcast input to sum over from the shapes it
infers. ``position_ids[:, :seq]`` (a slice of a buffer, as Hugging Face BERT/RoBERTa write it) comes out
with two unknown dimensions, which the builder takes to be equal to the batch dimension it is added to:
it skipped the sum over the batch, so the position table's gradient held only the first sequence's part
(without the graph rewrites) or read past the gradient buffer and aborted the process (with them).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer._export import export_torch_model
from ort_trainer.graph import pin_broadcast_dims
from ort_trainer.model_desc import validate_model_desc
from tests.hf_tiny import HF_CLASSIFIER_DESC, BertClassifier, classifier_batch
from tests.models import LM_DESC, lm_batches, lm_loss
from tests.test_graph_rewrites import _assert_close, _ort_loss_and_grads, _torch_loss_and_grads

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


def _feeds(batch):
    return {name: t.numpy() for name, t in zip(("tokens", "label"), batch, strict=True)}


def test_gradient_builder_alone_drops_the_batch_sum():
    """Documents the ONNX Runtime behaviour the pass works around (if this starts passing, ORT fixed it)."""
    torch.manual_seed(0)
    model = SlicedPositions()
    batch = lm_batches(1, batch=3, seq=6, vocab=40)[0]
    _, grads, _ = _ort_loss_and_grads(model, lm_loss, LM_DESC, batch, None)
    _, expected = _torch_loss_and_grads(model, lm_loss, batch)
    assert not torch.allclose(grads["positions.weight"], expected["positions.weight"], atol=1e-6)


@pytest.mark.parametrize("with_rewrites", [False, True])
def test_pinned_graph_gradients_match_torch(with_rewrites):
    from ort_trainer.graph import apply_forward_rewrites

    torch.manual_seed(0)
    model = SlicedPositions()
    batch = lm_batches(1, batch=3, seq=6, vocab=40)[0]

    def rewrite(forward):
        changed = pin_broadcast_dims(forward, _feeds(batch))
        return changed + (apply_forward_rewrites(forward) if with_rewrites else 0)

    loss, grads, changed = _ort_loss_and_grads(model, lm_loss, LM_DESC, batch, rewrite)
    assert changed >= 1
    _assert_close((loss, grads), _torch_loss_and_grads(model, lm_loss, batch))


def test_nothing_to_pin_leaves_the_graph_alone():
    torch.manual_seed(0)
    model = SlicedPositions()
    batch = lm_batches(1, batch=1, seq=6, vocab=40)[0]  # batch 1: nothing is broadcast in this sample
    desc = validate_model_desc(LM_DESC, require_loss=True)
    forward = export_torch_model(model, lm_loss, desc, batch, 17).model
    before = forward.SerializeToString()
    assert pin_broadcast_dims(forward, _feeds(batch)) == 0
    assert forward.SerializeToString() == before


def test_trainer_updates_the_position_table_like_torch():
    torch.manual_seed(0)
    model = SlicedPositions()
    batches = lm_batches(2, batch=3, seq=6, vocab=40)
    trainer = ORTTrainer(copy.deepcopy(model), LM_DESC, optim.SGDConfig(lr=0.5), loss_fn=lm_loss)
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for tokens, label in batches:
        loss = trainer.train_step(tokens, label)
        sgd.zero_grad()
        expected = lm_loss(reference(tokens), label)
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    got = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_hugging_face_bert_trains_like_torch():
    """BertForSequenceClassification slices its position ids from a buffer: the case that crashed."""
    torch.manual_seed(0)
    model = BertClassifier()
    batches = [classifier_batch(seed=s) for s in range(2)]
    trainer = ORTTrainer(copy.deepcopy(model), HF_CLASSIFIER_DESC, optim.SGDConfig(lr=0.5), loss_fn=ce)
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for *inputs, label in batches:
        loss = trainer.train_step(*inputs, label)
        sgd.zero_grad()
        expected = ce(reference(*inputs), label)
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    got = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


class _DroppedPositions(SlicedPositions):
    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, tokens):  # dropout before the broadcast add: the probe runs it
        positions = self.position_ids[:, : tokens.shape[1]]
        return self.head(self.dropout(self.tokens(tokens)) + self.positions(positions))


def test_the_shape_probe_leaves_ort_random_state_alone():
    """Users reseed ORT's global generator to replay dropout masks (samples/resume_lm.py): the probe run at
    build time must not draw from it."""
    import onnxruntime

    torch.manual_seed(0)
    model = _DroppedPositions()
    batch = lm_batches(1, batch=3, seq=6, vocab=40)[0]
    desc = validate_model_desc(LM_DESC, require_loss=True)
    forward = export_torch_model(model, lm_loss, desc, batch, 17).model
    session = onnxruntime.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
    onnxruntime.set_seed(123)
    expected = session.run(None, _feeds(batch))[0]
    onnxruntime.set_seed(123)
    assert pin_broadcast_dims(copy.deepcopy(forward), _feeds(batch)) == 1  # ran the probe
    assert session.run(None, _feeds(batch))[0] == expected


def test_a_probe_that_cannot_run_warns_and_changes_nothing():
    torch.manual_seed(0)
    model = SlicedPositions()
    batch = lm_batches(1, batch=3, seq=6, vocab=40)[0]
    desc = validate_model_desc(LM_DESC, require_loss=True)
    forward = export_torch_model(model, lm_loss, desc, batch, 17).model
    before = forward.SerializeToString()
    with pytest.warns(RuntimeWarning, match="could not run the forward graph on the first batch"):
        assert pin_broadcast_dims(forward, {"tokens": batch[0].numpy()}) == 0  # the label is missing
    assert forward.SerializeToString() == before
