"""A preempted ``ort_trainer.hf.Trainer`` resumes by itself (issue S, points 3 and 5).

A save killed part-way leaves the newest ``checkpoint-N`` incomplete; ``resume_from_checkpoint=True`` resumes
from the newest complete one and ends bit-exact to the run that was never stopped (the SIGKILL at every phase
of a save, ``faults``). A folder whose two step counts disagree is refused naming both; a resume with
another ``gradient_accumulation_steps`` trains as ``transformers.Trainer`` does. The checks of a folder run on
folders laid out as a save leaves them (`_saved_folder`), without training.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
import transformers

from ort_trainer import checkpoint
from ort_trainer.hf import _files
from tests.hf.common import OrtHFTrainer, TokenData, arguments, assert_weights_close, gpt2, pad_collate, run

OVERRIDES = dict(max_steps=6, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2,
                 lr_scheduler_type="cosine")  # fmt: skip


def _trainer(output_dir, model=None, **overrides):
    args = arguments(output_dir, **{**OVERRIDES, **overrides})
    return OrtHFTrainer(model=model or gpt2(seed=11), args=args, train_dataset=TokenData(24), data_collator=pad_collate)


def _saved_folder(folder, step: int, updates: int | None = None):
    """What a completed save leaves in ``folder`` (HF's weights and state, our counters, the random state)."""
    gpt2().save_pretrained(folder)
    state = transformers.TrainerState(global_step=step, max_steps=6, train_batch_size=4)
    state.save_to_json(str(folder / "trainer_state.json"))
    updates = step if updates is None else updates
    counters = {"step": 2 * updates, "optimization_step": updates}
    checkpoint.save({"train_step_info": counters}, folder / "ort_trainer.ortcp")
    _files.save_rng_state(folder / "rng_state.ortcp")
    return folder


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run: its folder (checkpoint-2, -4, -6), its logged losses and its final weights."""
    folder = tmp_path_factory.mktemp("full")
    trainer, losses, _ = run(OrtHFTrainer, gpt2(), arguments(folder, **OVERRIDES))
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return folder, losses, weights


def _half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


AFTER_WEIGHTS = ("ort_trainer.ortcp", "rng_state.ortcp", "trainer_state.json")
# what a save killed at each phase leaves in checkpoint-N (HF: weights, ours, rng, trainer_state.json last)
BROKEN = {
    "weights only": lambda f: [(f / n).unlink() for n in AFTER_WEIGHTS],
    "our temporary file": lambda f: [
        (f / "ort_trainer.ortcp").rename(f / ".ort_trainer.ortcp.tmp-host-1"),
        (f / "rng_state.ortcp").unlink(),
        (f / "trainer_state.json").unlink(),
    ],
    "no trainer_state.json": lambda f: (f / "trainer_state.json").unlink(),
    "half of trainer_state.json": lambda f: _half(f / "trainer_state.json"),
    "half of the weights, nothing else": lambda f: [
        _half(f / "model.safetensors"),
        *[(f / n).unlink() for n in AFTER_WEIGHTS],
    ],
    "no random state": lambda f: (f / "rng_state.ortcp").unlink(),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_an_incomplete_folder_is_told_apart_from_a_complete_one(tmp_path, broken):
    folder = _saved_folder(tmp_path / "checkpoint-4", 4)
    assert _files.checkpoint_problem(folder, 1) is None
    BROKEN[broken](folder)
    assert _files.checkpoint_problem(folder, 1) is not None
    _saved_folder(tmp_path / "checkpoint-2", 2)
    newest, skipped = _files.newest_complete_checkpoint(tmp_path, 1)
    assert newest == tmp_path / "checkpoint-2" and len(skipped) == 1 and "checkpoint-4" in skipped[0]


def test_resume_true_skips_the_incomplete_newest_folder_and_ends_bit_exact(full_run, tmp_path, caplog):
    full, losses, weights = full_run
    for step in (2, 4):
        shutil.copytree(full / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    BROKEN["half of trainer_state.json"](tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / ".ort_trainer.ortcp.tmp-host-1").write_bytes(b"\0" * 100)
    resumed = _trainer(tmp_path)
    with caplog.at_level("WARNING", logger="ort_trainer.hf"):
        resumed.train(resume_from_checkpoint=True)
    assert any("checkpoint-4" in r.getMessage() and "trainer_state.json" in r.getMessage() for r in caplog.records)
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 2] == losses[2:]
    for key, value in weights.items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert _files.checkpoint_problem(tmp_path / "checkpoint-4", 1) is None  # saved again, complete


def test_resume_true_without_a_complete_folder_says_why(tmp_path):
    _saved_folder(tmp_path / "checkpoint-2", 2)
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=r"No valid checkpoint found.*checkpoint-2: no trainer_state\.json"):
        _trainer(tmp_path).train(resume_from_checkpoint=True)


def test_an_incomplete_folder_named_explicitly_is_refused_naming_what_it_lacks(tmp_path):
    folder = _saved_folder(tmp_path / "checkpoint-4", 4)
    BROKEN["half of trainer_state.json"](folder)
    _saved_folder(tmp_path / "checkpoint-2", 2)
    with pytest.raises(ValueError, match=r"trainer_state\.json is incomplete.*newest complete folder.*checkpoint-2"):
        _trainer(tmp_path / "out").train(resume_from_checkpoint=str(folder))


def test_a_folder_whose_step_counts_disagree_is_refused_naming_both(tmp_path):
    mixed = _saved_folder(tmp_path / "checkpoint-4", 4, updates=2)  # our file from the save at update 2
    with pytest.raises(ValueError, match=r"global_step=4.*optimization_step=2"):
        _trainer(tmp_path / "out").train(resume_from_checkpoint=str(mixed))


@pytest.mark.hf_long
def test_resume_with_another_accumulation_trains_like_transformers_trainer(tmp_path):
    """Saved with gradient_accumulation_steps=1 after 3 updates (micro-step 3), resumed with 2: HF's windows
    start at the resumed update, and so must ORTTrainer's (micro-step 3 is inside a window of 2)."""
    first = dict(max_steps=3, save_strategy="steps", save_steps=3, gradient_accumulation_steps=1,
                 lr_scheduler_type="constant", warmup_steps=0)  # fmt: skip
    second = {**first, "max_steps": 5, "gradient_accumulation_steps": 2}
    finished = {}
    for name, cls in (("torch", transformers.Trainer), ("ort", OrtHFTrainer)):
        folder = tmp_path / name
        run(cls, gpt2(), arguments(folder, **first))
        trainer = cls(model=gpt2(seed=3), args=arguments(folder, **second), train_dataset=TokenData(24),
                      data_collator=pad_collate)  # fmt: skip
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-3"))
        finished[name] = trainer
    assert finished["ort"].ort_trainer.train_step_info.step == 10  # 5 updates x 2 micro-steps (re-based at 3 x 2)
    assert_weights_close(finished["ort"].model, finished["torch"].model)


def test_resume_checks_read_only_the_counters_of_our_file(full_run):
    folder = full_run[0] / "checkpoint-4"
    assert _files.saved_steps(folder / "ort_trainer.ortcp") == (8, 4)
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 4
    assert _files.checkpoint_problem(folder, 1) is None  # a real save's folder is complete


def _phases() -> tuple[str, ...]:
    from tests.hf.hf_kill_worker import PHASES

    return PHASES


@pytest.fixture(scope="module")
def kill_server():
    """``python -m tests.hf.hf_kill_worker --serve``: each killed run is a child it forks after importing torch,
    transformers and the tracer once (a fresh interpreter per phase spent most of its time importing them)."""
    import subprocess
    import sys
    import threading
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.hf.hf_kill_worker", "--serve"], cwd=root, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    watchdog = threading.Timer(1800, proc.kill)  # the phases' runs together (600 s each before)
    watchdog.start()
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)
    watchdog.cancel()


@pytest.mark.faults
@pytest.mark.processes
@pytest.mark.parametrize("phase", _phases())
def test_a_run_killed_at_any_phase_of_a_save_resumes_bit_exact(full_run, kill_server, tmp_path, phase):
    """SIGKILL at each phase of the save of checkpoint-4 (save_total_limit=1), then resume_from_checkpoint=True:
    the same losses after the resumed update and the same final weights, bit for bit."""
    _, losses, weights = full_run
    log = tmp_path.parent / f"{tmp_path.name}.log"  # beside the run's folder, not in it
    kill_server.stdin.write(json.dumps([str(tmp_path), phase, str(log)]) + "\n")
    kill_server.stdin.flush()
    answer = kill_server.stdout.readline()
    assert answer, "the kill server died"
    status = int(answer)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, log.read_text()[-4000:])
    resumed = _trainer(tmp_path, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    after = [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 4]
    assert after == losses[4:]  # from checkpoint-2 or checkpoint-4, whichever the kill left complete
    for key, value in weights.items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
