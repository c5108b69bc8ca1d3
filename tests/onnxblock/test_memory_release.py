"""Freed build and first-run scratch goes back to the OS: one trim after the build, one after the first run."""

from __future__ import annotations

import torch

import ort_trainer.engine.onnxblock._build as build_module
import ort_trainer.engine.onnxblock._session as session_module
from ort_trainer import ORTTrainer, optim
from tests.models import MLP, MLP_DESC, mlp_batches

ce = torch.nn.functional.cross_entropy


def test_memory_is_released_after_the_build_and_once_after_the_first_training_run(monkeypatch):
    calls = []
    monkeypatch.setattr(build_module, "release_freed_memory", lambda: calls.append("build"))
    monkeypatch.setattr(session_module, "release_freed_memory", lambda: calls.append("first run"))
    trainer = ORTTrainer(MLP(), MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    batches = mlp_batches(4)
    trainer.eval_step(*batches[0])
    assert calls == ["build"]  # an eval run before training does not count
    for batch in batches:
        trainer.train_step(*batch)
    assert calls == ["build", "first run"]  # not once per step: a trim costs a garbage collection
