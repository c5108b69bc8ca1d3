"""The onnxblock engine's side of the trainer API: ``check_model_export`` and the debug graph files, and the clear
error for a dimension the TorchScript exporter baked in (the rest: tests/trainer/test_trainer_api.py)."""

from __future__ import annotations

import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.builders import mlp_trainer
from tests.models import mlp_batches


def test_check_model_export_and_graph_save_paths(tmp_path):
    options = {
        "debug": {
            "check_model_export": True,
            "graph_save_paths": {"model_with_gradient_graph_path": str(tmp_path / "grad.onnx")},
        }
    }
    trainer = mlp_trainer(**options)
    trainer.train_step(*mlp_batches(1)[0])
    graph = onnx.load(str(tmp_path / "grad.onnx"))
    assert any(node.op_type == "InPlaceAccumulatorV2" for node in graph.graph.node)


def test_dimension_baked_by_the_exporter_gets_a_clear_error():
    from tests.models import LM_DESC, TinyLM, lm_loss

    trainer = ORTTrainer(TinyLM(), LM_DESC, optim.AdamConfig(lr=1e-3), loss_fn=lm_loss)
    tokens = torch.randint(0, 50, (4, 8))
    trainer.train_step(tokens, tokens)
    trainer.train_step(tokens[:2], tokens[:2])  # the batch dimension really is dynamic
    with pytest.raises(ValueError, match="tokens axis 1: traced with 8, got 5.*keep that dimension fixed"):
        trainer.train_step(tokens[:, :5], tokens[:, :5])
    assert trainer.train_step_info.step == 2  # the failed step was not counted
