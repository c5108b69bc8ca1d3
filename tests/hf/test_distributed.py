"""Data parallel: 2 gloo ranks on 127.0.0.1 (torchrun's environment variables, ZeRO stage 1 through ort_options)
train like one process with the global batch: same logged losses, same final weights; the checkpoint folders
hold the rank files of our checkpoint, a manifest and one random-state file per rank."""

from __future__ import annotations

import json

import pytest
import transformers

from tests.hf.common import OrtHFTrainer, arguments, assert_losses_close, assert_weights_close, gpt2, run
from tests.hf.ddp_worker import OVERRIDES
from tests.ranks import run_ranks


@pytest.mark.processes
@pytest.mark.hf_long
def test_two_ranks_train_like_one_process_with_the_global_batch(tmp_path):
    run_ranks(2, ["-m", "tests.hf.ddp_worker", str(tmp_path / "ddp")], timeout_s=400)
    single = dict(OVERRIDES, per_device_train_batch_size=4, save_strategy="no")
    single.pop("ddp_backend")
    reference, expected, _ = run(OrtHFTrainer, gpt2(), arguments(tmp_path / "single", **single))
    # and the single process itself equals transformers.Trainer on PyTorch
    torch_run, torch_losses, _ = run(transformers.Trainer, gpt2(), arguments(tmp_path / "torch", **single))
    assert_losses_close(expected, torch_losses)

    losses = json.loads((tmp_path / "ddp" / "losses.json").read_text())
    assert_losses_close(losses, expected)
    ddp_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ddp" / "final")
    assert_weights_close(ddp_model, reference.model)
    assert_weights_close(ddp_model, torch_run.model)
    folder = tmp_path / "ddp" / "checkpoint-2"
    names = {p.name for p in folder.iterdir()}
    assert {"ort_trainer.ortcp.manifest.json", "rng_state_0.ortcp", "rng_state_1.ortcp", "trainer_state.json"} <= names
    assert sum(n.startswith("ort_trainer.rank") for n in names) == 2, names
