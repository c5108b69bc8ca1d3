"""An empty input (a sequence of length 0) is refused by `ORTModule` with a ValueError naming it, never run.

ONNX Runtime does not compute on empty tensors as PyTorch does: a mean over no elements is 0 there and NaN in
PyTorch, so a (2, 0) batch of token ids gave a finite loss where eager PyTorch gives NaN.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTModule


class _MeanLM(torch.nn.Module):
    """Embedding + head, the loss inside the module: the mean of the logits (NaN over an empty sequence)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, ids, labels=None):
        logits = self.head(self.embed(ids))
        if labels is None:
            return logits.mean()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_an_empty_sequence_is_refused_naming_the_input_and_its_zero_size_dim():
    torch.manual_seed(0)
    model = _MeanLM()
    empty = torch.randint(0, 10, (2, 0))
    assert torch.isnan(copy.deepcopy(model)(empty))  # what eager PyTorch gives: ORTModule gave 0.0
    wrapped = ORTModule(model)
    with pytest.raises(ValueError, match=r"`ids`.*\(2, 0\).*size 0 in dim 1"):
        wrapped(empty)


def test_an_empty_keyword_input_after_a_first_call_is_refused_and_later_batches_train_as_in_eager():
    torch.manual_seed(0)
    model = _MeanLM()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    ids = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(wrapped(ids, labels=ids), reference(ids, labels=ids))
    empty = torch.randint(0, 10, (2, 0))
    assert torch.isnan(reference(ids=empty, labels=empty))  # cross_entropy over no tokens: NaN in eager
    with pytest.raises(ValueError, match=r"`ids`.*\(2, 0\).*size 0 in dim 1"):
        wrapped(ids=empty, labels=empty)
    loss, expected = wrapped(ids, labels=ids), reference(ids, labels=ids)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"{n}: {m}")
