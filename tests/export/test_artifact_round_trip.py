"""A state trained by a driver comes back: 10 steps in the artifact + 10 in ORTTrainer == 20 in ORTTrainer.

Three ways back: ``load_training_state(...).trainer_state_dict()`` into ``ORTTrainer.load_state_dict``; the
``ort-trainer-ckpt convert`` command line to an HDF5 checkpoint, then ``ORTTrainer.load_checkpoint``; and a plain
PyTorch ``load_state_dict`` (tied weights included). And the other way: an ORTTrainer mid-run exported, its
artifact continues the run.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from ort_trainer import ArtifactRunner, ORTTrainer, export_training, load_training_state
from tests.export.artifacts import feeds, gpt2_case, mlp_case, optimizers

TOLERANCE = 1e-6


def _reference(case, config, batches):
    trainer = ORTTrainer(case.model(), case.desc, config(), loss_fn=case.loss_fn)
    losses = [float(trainer.train_step(*b)) for b in batches]
    return losses, trainer.state_dict()["model"]["full_precision"]


def _first_half_in_the_artifact(case, config, batches, folder):
    export_training(case.model(), folder, inputs=batches[0], model_desc=case.desc, optimizer=config(),
                    loss_fn=case.loss_fn)  # fmt: skip
    runner = ArtifactRunner(folder, threads=1)
    losses = [runner.train_step(feeds(runner, b), config().lr) for b in batches[:10]]
    saved = runner.save_state(folder.parent / "trained.safetensors")  # as a driver saves it back
    return losses, saved


def _assert_same_run(losses, trainer, reference):
    ref_losses, ref_weights = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=TOLERANCE)
    weights = trainer.state_dict()["model"]["full_precision"]
    assert weights.keys() == ref_weights.keys()
    for name, value in weights.items():
        assert float((value - ref_weights[name]).abs().max()) <= TOLERANCE, name


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_ten_steps_in_the_artifact_then_ten_in_the_trainer_equal_twenty_in_the_trainer(tmp_path, name):
    case, config = mlp_case(), optimizers()[name]
    batches = case.batches(20)
    reference = _reference(case, config, batches)
    losses, saved = _first_half_in_the_artifact(case, config, batches, tmp_path / "artifact")

    state = load_training_state(tmp_path / "artifact", state=saved)
    assert state.step == 10
    trainer = ORTTrainer(case.model(), case.desc, config(), loss_fn=case.loss_fn)
    trainer.load_state_dict(state.trainer_state_dict())
    assert trainer.train_step_info.optimization_step == 10
    resumed = losses + [float(trainer.train_step(*b)) for b in batches[10:]]
    _assert_same_run(resumed, trainer, reference)


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_the_checkpoint_command_line_converts_a_driver_s_state_and_load_checkpoint_resumes_it(tmp_path, name):
    case, config = mlp_case(), optimizers()[name]
    batches = case.batches(20)
    reference = _reference(case, config, batches)
    losses, saved = _first_half_in_the_artifact(case, config, batches, tmp_path / "artifact")
    (tmp_path / "artifact" / "state.safetensors").write_bytes(saved.read_bytes())  # saved back into the folder

    checkpoint = tmp_path / "resumed.ortcp"
    command = [
        sys.executable,
        "-m",
        "ort_trainer.checkpoint",
        "convert",
        str(tmp_path / "artifact"),
        "-o",
        str(checkpoint),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "update count 10" in done.stdout
    trainer = ORTTrainer(case.model(), case.desc, config(), loss_fn=case.loss_fn)
    trainer.load_checkpoint(checkpoint)
    resumed = losses + [float(trainer.train_step(*b)) for b in batches[10:]]
    _assert_same_run(resumed, trainer, reference)


def test_a_state_file_alone_converts_with_the_optimizer_named(tmp_path):
    case, config = mlp_case(), optimizers()["lamb"]
    batches = case.batches(20)
    reference = _reference(case, config, batches)
    losses, saved = _first_half_in_the_artifact(case, config, batches, tmp_path / "artifact")
    checkpoint = tmp_path / "resumed.ortcp"
    command = [sys.executable, "-m", "ort_trainer.checkpoint", "convert", str(saved), "-o", str(checkpoint),
               "--optimizer-name", "LambOptimizer"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    trainer = ORTTrainer(case.model(), case.desc, config(), loss_fn=case.loss_fn)
    trainer.load_checkpoint(checkpoint)
    resumed = losses + [float(trainer.train_step(*b)) for b in batches[10:]]
    _assert_same_run(resumed, trainer, reference)


def test_a_plain_torch_module_loads_the_trained_state_tied_weights_included(tmp_path):
    case, config = gpt2_case(), optimizers(lr=2e-3)["adamw"]
    batches = case.batches(4)
    export_training(case.model(), tmp_path / "gpt2", inputs=batches[0], model_desc=case.desc, optimizer=config(),
                    loss_fn=case.loss_fn)  # fmt: skip
    runner = ArtifactRunner(tmp_path / "gpt2", threads=1)
    for batch in batches:
        runner.train_step(feeds(runner, batch), 2e-3)
    saved = runner.save_state(tmp_path / "trained.safetensors")

    module = case.model()
    state = load_training_state(tmp_path / "gpt2", state=saved)
    result = module.load_state_dict(state.module_state_dict(module))
    assert not result.missing_keys and not result.unexpected_keys
    wte = module.model.transformer.wte.weight
    assert module.model.lm_head.weight is wte  # still tied
    np.testing.assert_array_equal(wte.detach().numpy(), runner.state["model.transformer.wte.weight"])
    # the module computes the eval graph's loss on the trained weights
    eval_loss = runner.eval_step(feeds(runner, batches[0]))["loss"]
    with torch.no_grad():
        torch_loss = case.loss_fn(module.eval()(*batches[0][:2]), batches[0][2])
    assert float(torch_loss) == pytest.approx(float(eval_loss), abs=1e-5)


def test_an_ortrainer_mid_run_exports_its_state_and_the_artifact_continues_the_run(tmp_path):
    case, config = mlp_case(), optimizers()["adamw"]
    batches = case.batches(20)
    reference = _reference(case, config, batches)
    trainer = ORTTrainer(case.model(), case.desc, config(), loss_fn=case.loss_fn)
    losses = [float(trainer.train_step(*b)) for b in batches[:10]]
    export_training(trainer, tmp_path / "artifact", inputs=batches[0])
    runner = ArtifactRunner(tmp_path / "artifact", threads=1)
    assert runner.step == 10 and runner.manifest["step"] == 10
    losses += [runner.train_step(feeds(runner, b), config().lr) for b in batches[10:]]
    np.testing.assert_allclose(losses, reference[0], rtol=0, atol=TOLERANCE)
    for name, value in reference[1].items():
        assert np.abs(runner.state[name] - value.numpy()).max() <= TOLERANCE, name
