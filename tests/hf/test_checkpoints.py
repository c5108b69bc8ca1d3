"""HF checkpoint folders hold our checkpoint: save_steps + save_total_limit rotate them, resuming (from True,
the newest folder) continues exactly like the uninterrupted run, load_best_model_at_end brings the best
weights back into both the PyTorch model and ONNX Runtime, and save_model writes a from_pretrained folder."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from ort_trainer import checkpoint
from tests.hf.common import OrtHFTrainer, TokenData, arguments, gpt2, pad_collate, run


def _trainer(model, args, **kwargs):
    return OrtHFTrainer(model=model, args=args, train_dataset=TokenData(24), data_collator=pad_collate, **kwargs)


def test_checkpoints_rotate_and_resume_like_the_uninterrupted_run(tmp_path):
    model = gpt2()
    overrides = dict(max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=2,
                     gradient_accumulation_steps=2, lr_scheduler_type="cosine")  # fmt: skip
    full, losses, _ = run(OrtHFTrainer, model, arguments(tmp_path / "full", **overrides))

    folders = sorted(p.name for p in (tmp_path / "full").iterdir() if p.name.startswith("checkpoint-"))
    assert folders == ["checkpoint-4", "checkpoint-6"]  # save_total_limit=2 removed checkpoint-2
    four = tmp_path / "full" / "checkpoint-4"
    names = {p.name for p in four.iterdir()}
    assert {"ort_trainer.ortcp", "rng_state.ortcp", "trainer_state.json", "model.safetensors"} <= names, names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"}, names  # nothing pickled
    saved = checkpoint.load(four / "ort_trainer.ortcp")
    assert saved["train_step_info"]["optimization_step"] == 4 and saved["train_step_info"]["step"] == 8

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(four, resumed_dir / "checkpoint-4")
    resumed = _trainer(gpt2(seed=11), arguments(resumed_dir, **overrides))  # other initial weights: all are loaded
    resumed.train(resume_from_checkpoint=True)
    tail = [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 4]
    assert tail == pytest.approx(losses[4:], rel=1e-6)
    assert resumed.state.global_step == 6
    for key, value in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, atol=1e-6, rtol=1e-6, msg=key)

    # resume_from_checkpoint=<folder> (here the full run's own checkpoint-4) continues the same way
    again = _trainer(gpt2(seed=12), arguments(tmp_path / "again", **overrides))
    again.train(resume_from_checkpoint=str(four))
    assert [e["loss"] for e in again.state.log_history if "loss" in e and e["step"] > 4] == tail
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key

    # save_model: a plain HF folder (safetensors + config) that from_pretrained loads
    resumed.save_model(tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, full.model.state_dict()[key], atol=1e-6, rtol=1e-6, msg=key)


def test_resume_needs_our_state_in_the_folder(tmp_path):
    folder = tmp_path / "checkpoint-2"
    gpt2().save_pretrained(folder)  # what transformers.Trainer leaves there, less its pickled optimizer
    state = transformers.TrainerState(global_step=2, max_steps=3, train_batch_size=4)
    state.save_to_json(str(folder / "trainer_state.json"))
    trainer = _trainer(gpt2(), arguments(tmp_path, max_steps=3))
    with pytest.raises(FileNotFoundError, match="ort_trainer.ortcp"):
        trainer.train(resume_from_checkpoint=str(folder))


def test_load_best_model_at_end_restores_the_best_weights_everywhere(tmp_path):
    evaluate = TokenData(8, seed=5)
    args = arguments(tmp_path, max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="eval_loss", learning_rate=0.05,
                     lr_scheduler_type="constant", warmup_steps=0)  # fmt: skip
    trainer = _trainer(gpt2(), args, eval_dataset=evaluate)
    trainer.train()
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best_step = min(evals, key=evals.get)
    assert best_step < 6, evals  # the best is not the last: loading it changes the weights
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    best = transformers.GPT2LMHeadModel.from_pretrained(trainer.state.best_model_checkpoint)
    for key, value in best.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[key], value, msg=key)
    # ONNX Runtime got the best weights too: evaluate() gives the best eval loss again
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[best_step], rel=1e-5)


@pytest.mark.hf_long
def test_model_init_gives_every_train_call_a_fresh_model_and_trainer(tmp_path):
    trainer = OrtHFTrainer(model_init=lambda: gpt2(seed=4), args=arguments(tmp_path, max_steps=3),
                           train_dataset=TokenData(24), data_collator=pad_collate)  # fmt: skip
    trainer.train()
    first, graph = [e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.ort_trainer
    trainer.train()
    assert trainer.ort_trainer is not graph
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e] == pytest.approx(first, rel=1e-6)
