"""The spawned side of tests/onnxblock/test_shared_storage_onnxblock.py: a module received through a
``torch.multiprocessing`` queue (its storages in shared memory) trained by an ``ORTTrainer`` on the engine the
parent names."""

from __future__ import annotations

from typing import Any

import torch

from ort_trainer import ORTTrainer, optim
from tests.models import CNN_DESC, cnn_batches

ce = torch.nn.functional.cross_entropy


def train_received_module(inbox: Any, outbox: Any) -> None:
    """Receive ``(module, engine)``, report whether its storages arrived shared, train it three SGD steps on
    ``engine``, and send back the losses, an eval loss and the module's state (numpy arrays)."""
    module, engine = inbox.get(timeout=120)
    shared = all(t.is_shared() for t in module.state_dict().values())
    trainer = ORTTrainer(module, CNN_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options={"utils": {"engine": engine}})
    losses = [float(trainer.train_step(*batch)) for batch in cnn_batches(3)]
    evaluated = float(trainer.eval_step(*cnn_batches(1)[0]))
    state = {name: value.numpy().copy() for name, value in module.state_dict().items()}  # by value: the worker
    # exits at once, and a tensor would be sent as a shared-memory handle the parent opens after that
    outbox.put({"shared": shared, "engine": trainer.engine, "losses": losses, "eval": evaluated, "state": state})
