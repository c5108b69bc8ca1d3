"""CheckpointManager: keep rules, pruning after durability, restore-latest past damage, foreign files, readers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointManager
from ort_trainer.checkpoint.manager._policy import RetentionPolicy
from tests.builders import mlp_trainer
from tests.models import mlp_batches
from tests.paths import REPO

BATCHES = mlp_batches(8)


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_keep_rules():
    steps = [(s, {"loss": float(10 - s) if s != 7 else 0.5, "acc": s / 10}) for s in range(1, 10)]
    assert RetentionPolicy.create(None, None, None).kept(steps) == set(range(1, 10))
    assert RetentionPolicy.create(2, None, None).kept(steps) == {8, 9}
    assert RetentionPolicy.create(1, 4, None).kept(steps) == {4, 8, 9}
    assert RetentionPolicy.create(None, None, ("loss", "min", 1)).kept(steps) == {7, 9}  # newest always kept
    assert RetentionPolicy.create(1, None, ("acc", "max", 1)).kept(steps) == {9}
    with pytest.raises(ValueError, match="keep_last must be an int >= 1 or None, got 0"):
        CheckpointManager("x", keep_last=0)
    with pytest.raises(ValueError, match="the mode must be 'min' or 'max', got 'lowest'"):
        CheckpointManager("x", keep_best=("loss", "lowest", 1))
    with pytest.raises(ValueError, match=r"keep_best must be \(metric, mode, k\)"):
        CheckpointManager("x", keep_best="loss")


def test_pruning_keeps_the_rules_and_never_touches_foreign_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    checkpoint.save({"x": 1}, run / "ckpt-000000099.ortcp")  # named like ours, but not written by the manager
    manager = CheckpointManager(run, keep_last=2, keep_every_n_steps=4)
    trainer = mlp_trainer()
    for step, batch in enumerate(BATCHES[:6], start=1):
        trainer.train_step(*batch)
        handle = manager.save(trainer, metrics={"loss": 1.0 / step})
        assert handle.done()
    assert _names(run) == [
        "ckpt-000000004.ortcp",
        "ckpt-000000005.ortcp",
        "ckpt-000000006.ortcp",
        "ckpt-000000099.ortcp",
        "notes.txt",
        "ort_trainer_checkpoints.json",
    ]
    index = json.loads((run / "ort_trainer_checkpoints.json").read_text())
    assert [(e["step"], e["metrics"]) for e in index["checkpoints"]] == [
        (4, {"loss": 0.25}),
        (5, {"loss": 0.2}),
        (6, {"loss": 1 / 6}),
    ]
    # the foreign file is a checkpoint too for readers (it is the newest), but pruning never deletes it
    assert [c.step for c in manager.checkpoints()] == [4, 5, 6, 99]


def test_async_manager_prunes_after_the_new_checkpoint_is_durable(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1, async_save=True)
    trainer = mlp_trainer(hidden=2048)
    for batch in BATCHES[:3]:
        trainer.train_step(*batch)
        manager.save(trainer)
    manager.wait()
    assert _names(tmp_path) == ["ckpt-000000003.ortcp", "ort_trainer_checkpoints.json"]
    assert manager.latest().step == 3 and manager.latest().path == str(tmp_path / "ckpt-000000003.ortcp")


def _flip_a_data_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # inside the last dataset's bytes: only the checksums can tell
    path.write_bytes(bytes(data))


def test_restore_takes_the_latest_complete_checkpoint_skipping_damaged_and_unfinished_ones(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    trainer = mlp_trainer()
    saved = {}
    for step, batch in enumerate(BATCHES[:3], start=1):
        trainer.train_step(*batch)
        manager.save(trainer, user_dict={"step": step})
        saved[step] = trainer.state_dict(pytorch_format=True)
    _flip_a_data_byte(tmp_path / "ckpt-000000003.ortcp")
    index = json.loads((tmp_path / "ort_trainer_checkpoints.json").read_text())  # a save of step 4 that was killed
    index["checkpoints"].append({"step": 4, "name": "ckpt-000000004.ortcp", "metrics": {}, "time": 0.0})
    (tmp_path / "ort_trainer_checkpoints.json").write_text(json.dumps(index))

    fresh = mlp_trainer()
    with caplog.at_level(logging.WARNING, logger="ort_trainer.checkpoint"):
        restored = CheckpointManager(tmp_path).restore(fresh)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ort_trainer.checkpoint.manager")]
    assert any("ckpt-000000004.ortcp (step 4): the save did not complete" in m for m in messages), messages
    assert any("ckpt-000000003.ortcp (step 3): CheckpointCorruptError" in m for m in messages), messages
    assert restored.step == 2 and restored.user_dict == {"step": 2}
    fresh.train_step(*BATCHES[2])  # the loaded state is applied with the first step
    trainer_from_2 = mlp_trainer()
    trainer_from_2.load_checkpoint(tmp_path / "ckpt-000000002.ortcp")
    trainer_from_2.train_step(*BATCHES[2])
    for name, value in trainer_from_2.state_dict(pytorch_format=True).items():
        assert torch.equal(fresh.state_dict(pytorch_format=True)[name], value), name


def test_restore_of_an_empty_or_hopeless_directory(tmp_path, caplog):
    assert CheckpointManager(tmp_path / "new").restore(mlp_trainer()) is None  # fresh start; nothing created
    assert not (tmp_path / "new").exists()
    manager = CheckpointManager(tmp_path / "run")
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    manager.save(trainer)
    _flip_a_data_byte(tmp_path / "run" / "ckpt-000000001.ortcp")
    with (
        caplog.at_level(logging.WARNING, logger="ort_trainer.checkpoint"),
        pytest.raises(checkpoint.CheckpointCorruptError, match="no checkpoint in .* could be restored"),
    ):
        manager.restore(mlp_trainer())
    assert any("skipping checkpoint" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_checkpoint_of_another_model_is_an_error_not_a_skip(tmp_path):
    manager = CheckpointManager(tmp_path)
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    manager.save(trainer)
    other = mlp_trainer(hidden=8)
    with pytest.raises(ValueError, match="shape"):
        manager.restore(other)


def test_bad_directories_are_clear_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file exists and is not a directory"):
        CheckpointManager(tmp_path / "file")
    (tmp_path / "ort_trainer_checkpoints.json").write_text('{"someone": "else"}')
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    with pytest.raises(checkpoint.CheckpointFormatError, match="ort_trainer_checkpoints.json is not an ort_trainer"):
        CheckpointManager(tmp_path).save(trainer)
    assert (tmp_path / "ort_trainer_checkpoints.json").read_text() == '{"someone": "else"}'  # not written over
    assert not list(tmp_path.glob("ckpt-*"))
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        CheckpointManager(tmp_path / "ok").save(trainer, -1)
    with pytest.raises(TypeError, match="metric 'loss' must be a number, got str"):
        CheckpointManager(tmp_path / "ok").save(trainer, 1, metrics={"loss": "low"})


@pytest.mark.processes
def test_another_process_reads_the_run_directory_while_training_goes_on(tmp_path):
    manager = CheckpointManager(tmp_path, keep_best=("loss", "min", 1), async_save=True)
    trainer = mlp_trainer()
    for batch in BATCHES[:3]:
        loss = trainer.train_step(*batch)
        manager.save(trainer, metrics={"loss": loss})
    manager.wait()
    code = (
        "import sys; from ort_trainer.checkpoint import CheckpointManager; "
        "print([(c.step, round(c.metrics['loss'], 6)) for c in CheckpointManager(sys.argv[1]).checkpoints()])"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "ort_trainer_checkpoints.json").read_text())["checkpoints"]
    expected = [(e["step"], round(e["metrics"]["loss"], 6)) for e in index]
    assert result.stdout.strip() == str(expected) and 3 in [s for s, _ in expected]
