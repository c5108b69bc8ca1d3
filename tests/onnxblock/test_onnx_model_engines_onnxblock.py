"""An ``onnx.ModelProto`` trained by both engines alike, their checkpoints shared (the autograd engine alone:
tests/engine/test_onnx_model_engines.py)."""

from __future__ import annotations

import torch

from ort_trainer import ORTTrainer, optim
from tests.onnx_models import assert_state_matches, onnx_case, torch_sgd_steps


def test_both_engines_train_an_onnx_model_alike_and_share_its_checkpoints(tmp_path):
    """Marked ``onnxblock`` (tests/conftest.py): the onnxblock engine, the autograd engine and PyTorch, 4 SGD steps
    of the MLP and of the CNN (whose BatchNorm statistics the onnxblock engine had taken for parameters and failed
    on); then a checkpoint of one engine continues on the other."""
    for case in ("mlp", "cnn"):
        exported, reference, desc, batches = onnx_case(case)
        trainers = {e: ORTTrainer(exported, desc, optim.SGDConfig(lr=0.1), options={"utils": {"engine": e}})
                    for e in ("onnxblock", "autograd")}  # fmt: skip
        losses = {e: torch.stack([t.train_step(*b) for b in batches[:3]]) for e, t in trainers.items()}
        expected = torch.stack(torch_sgd_steps(reference, batches[:3]))
        for engine, trainer in trainers.items():
            torch.testing.assert_close(losses[engine], expected, atol=1e-5, rtol=1e-5, msg=f"{case} {engine}")
            assert_state_matches(trainer, reference)
        trainers["autograd"].save_checkpoint(tmp_path / f"{case}.ortcp")
        moved = ORTTrainer(exported, desc, optim.SGDConfig(lr=0.1), options={"utils": {"engine": "onnxblock"}})
        moved.load_checkpoint(tmp_path / f"{case}.ortcp")
        torch.testing.assert_close(
            moved.train_step(*batches[3]), trainers["autograd"].train_step(*batches[3]), atol=1e-5, rtol=1e-5
        )
        after = trainers["autograd"].state_dict()["model"]["full_precision"]
        for name, value in moved.state_dict()["model"]["full_precision"].items():
            torch.testing.assert_close(value, after[name], atol=1e-5, rtol=1e-5, msg=f"{case} {name}")
