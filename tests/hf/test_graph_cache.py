"""Two HF Trainers whose graphs the cache's pre-key cannot tell apart: the same model, configuration and batch
keys, but each with its own ``compute_loss_func`` (an attribute of the HF trainer, which the bound
``compute_loss`` that the loss wrapper calls reads): the first ignores ``num_items_in_batch``, the second divides
by it. The second finds the first's graph by its pre-key, the verifying trace rejects it, and the rebuilt graph
must be fed the input the rejected graph left unread (CI failed here: "Missing Input: num_items_in_batch") and
train as an uncached run does."""

from __future__ import annotations

import copy
import logging

import torch

from tests.hf.common import OrtHFTrainer, TokenData, arguments, gpt2, pad_collate

AUTOGRAD = {"utils": {"engine": "autograd"}}


def _token_losses(outputs, labels):
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none")


def mean_loss(outputs, labels, num_items_in_batch=None):
    """Ignores ``num_items_in_batch``: the graph does not read it."""
    losses = _token_losses(outputs, labels)
    return losses.sum() / (labels[:, 1:] != -100).sum()


def loss_over_num_items(outputs, labels, num_items_in_batch=None):
    return _token_losses(outputs, labels).sum() / num_items_in_batch


def _train(tmp_path, name, model, loss_func):
    trainer = OrtHFTrainer(
        model=copy.deepcopy(model), args=arguments(tmp_path / name, max_steps=3), train_dataset=TokenData(12),
        data_collator=pad_collate, compute_loss_func=loss_func, ort_options=AUTOGRAD,
    )  # fmt: skip
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_a_graph_that_left_num_items_unread_is_not_run_for_a_loss_that_reads_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE_DIR", str(tmp_path / "graphs"))
    monkeypatch.delenv("ORT_TRAINER_GRAPH_CACHE", raising=False)
    model = gpt2()
    _train(tmp_path, "unread", model, mean_loss)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    cached = _train(tmp_path, "read", model, loss_over_num_items)
    assert "rebuilding it from the trace" in caplog.text
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")
    fresh = _train(tmp_path, "fresh", model, loss_over_num_items)
    assert cached[0] == fresh[0]
    for name, value in fresh[1].items():
        torch.testing.assert_close(cached[1][name], value, rtol=0, atol=0, msg=name)
