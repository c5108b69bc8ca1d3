"""Two HF Trainers whose graphs only a trace tells apart: the same model, configuration and batch keys, but each
with its own ``compute_loss_func`` (an attribute of the HF trainer, which the bound ``compute_loss`` that the loss
wrapper calls reads): the first ignores ``num_items_in_batch``, the second divides by it. Each gets its own graph
from the cache (the second one reads the input the first left unread; with the removed pre-key, CI once failed here:
"Missing Input: num_items_in_batch"), each trains as ``transformers.Trainer`` does, and a third Trainer like the
first loads the first's graph."""

from __future__ import annotations

import copy
import logging

import torch
import transformers

from tests.hf.common import (
    OrtHFTrainer,
    TokenData,
    arguments,
    assert_losses_close,
    assert_weights_close,
    gpt2,
    pad_collate,
)

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


def _train(tmp_path, name, model, loss_func, trainer_cls=OrtHFTrainer):
    extra = {"ort_options": AUTOGRAD} if trainer_cls is OrtHFTrainer else {}
    trainer = trainer_cls(
        model=copy.deepcopy(model), args=arguments(tmp_path / name, max_steps=3), train_dataset=TokenData(12),
        data_collator=pad_collate, compute_loss_func=loss_func, **extra,
    )  # fmt: skip
    trainer.train()
    return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_two_trainers_whose_graphs_differ_each_get_their_own_and_train_as_transformers(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "graphs"
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE_DIR", str(folder))
    monkeypatch.delenv("ORT_TRAINER_GRAPH_CACHE", raising=False)
    model = gpt2()
    caplog.set_level(logging.INFO, logger="ort_trainer")
    unread = _train(tmp_path, "unread", model, mean_loss)
    stored = len(list(folder.glob("*.onnx")))
    caplog.clear()
    read = _train(tmp_path, "read", model, loss_over_num_items)
    assert "training graph loaded from" not in caplog.text  # its own graph, not the first's
    assert len(list(folder.glob("*.onnx"))) > stored
    caplog.clear()
    again = _train(tmp_path, "again", model, mean_loss)
    assert "graph cache: training graph loaded from" in caplog.text  # the first's graph, found by the trace's key
    for (ours, losses), loss_func in ((unread, mean_loss), (read, loss_over_num_items), (again, mean_loss)):
        reference, expected = _train(tmp_path, "torch", model, loss_func, transformers.Trainer)
        assert_losses_close(losses, expected)
        assert_weights_close(ours.model, reference.model)
    assert again[1] == unread[1] and read[1] != unread[1]
