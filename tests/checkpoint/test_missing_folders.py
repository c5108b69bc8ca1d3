"""Saving into folders that do not exist yet creates them (as DCP and orbax do), at the call.

Local paths (relative and absolute), ``file://`` and ``memory://`` URLs, synchronous and asynchronous
saves, ``checkpoint.save``, and both distributed styles on 2 gloo ranks (a shared path with a manifest,
one path per rank). A folder that cannot be made fails the save at once, with its path, on every rank.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.checkpoint.thread_ranks import save as save_on_thread_ranks
from tests.models import MLP, MLP_DESC, mlp_batches
from tests.ranks import run_ranks


def _trainer() -> ORTTrainer:
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=torch.nn.functional.cross_entropy)
    trainer.train_step(*mlp_batches(1)[0])
    return trainer


def _same_weights(trainer: ORTTrainer, path) -> None:
    other = _trainer()
    other.load_checkpoint(path)
    mine, theirs = trainer.state_dict(pytorch_format=True), other.state_dict(pytorch_format=True)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_relative_path_into_new_folders(tmp_path, monkeypatch, async_save):
    monkeypatch.chdir(tmp_path)
    trainer = _trainer()
    trainer.save_checkpoint("runs/exp1/step1.ortcp", async_save=async_save).wait()
    assert (tmp_path / "runs" / "exp1" / "step1.ortcp").is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "exp1").iterdir()) == ["step1.ortcp"]  # no leftovers
    _same_weights(trainer, tmp_path / "runs" / "exp1" / "step1.ortcp")


def test_urls_into_new_folders(tmp_path):
    trainer = _trainer()
    target = tmp_path / "a" / "b" / "ck.ortcp"
    trainer.save_checkpoint(f"file://{target}")
    _same_weights(trainer, target)
    url = f"memory://{uuid.uuid4().hex}/x/y/ck.ortcp"
    trainer.save_checkpoint(url, async_save=True).wait()
    _same_weights(trainer, url)


def test_checkpoint_save_creates_the_folder(tmp_path):
    checkpoint.save({"v": 1}, tmp_path / "x" / "y" / "c.ortcp")
    assert checkpoint.load(tmp_path / "x" / "y" / "c.ortcp") == {"v": 1}


def test_a_folder_that_cannot_be_made_fails_at_the_call_naming_it(tmp_path):
    (tmp_path / "file").write_text("a file where a folder should be")
    trainer = _trainer()
    with pytest.raises(OSError, match=r"cannot save .*file/sub/c\.ortcp: cannot create its folder"):
        trainer.save_checkpoint(tmp_path / "file" / "sub" / "c.ortcp", async_save=True)
    with pytest.raises(OSError, match=r"cannot save .*file/sub/c\.ortcp: cannot create its folder"):
        checkpoint.save({"v": 1}, tmp_path / "file" / "sub" / "c.ortcp")
    trainer.train_step(*mlp_batches(1)[0])  # the trainer goes on


def test_set_writers_on_every_rank_create_their_folders_or_all_refuse(tmp_path):
    results = save_on_thread_ranks(tmp_path / "one_path" / "deep" / "s.ortcp", 1.0)
    assert not any(isinstance(r, BaseException) for r in results), results
    state = checkpoint.aggregate_checkpoints(checkpoint.manifest_path(tmp_path / "one_path" / "deep" / "s.ortcp"))
    assert state["train_step_info"]["step"] == 1
    results = save_on_thread_ranks([tmp_path / "r0" / "a.ortcp", tmp_path / "r1" / "b" / "a.ortcp"], 1.0)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert (tmp_path / "r0" / "a.ortcp").is_file() and (tmp_path / "r1" / "b" / "a.ortcp").is_file()
    (tmp_path / "blocker").write_text("")
    results = save_on_thread_ranks([tmp_path / "ok" / "a.ortcp", tmp_path / "blocker" / "a.ortcp"], 1.0)
    assert all(isinstance(r, FileNotFoundError) and "rank 1: " in str(r) for r in results), results
    assert not (tmp_path / "ok" / "a.ortcp").exists()


@pytest.mark.processes
def test_two_gloo_ranks_save_into_new_folders_after_training(tmp_path):
    """The shared-path style (manifest + rank files); per-rank paths: the thread-rank test above."""
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "runs" / "exp1" / "ck.ortcp"
    run_ranks(2, ["-m", "tests.dist_worker", "--out", str(out), "--stop", "2", "--save", str(target)])
    state = checkpoint.aggregate_checkpoints(checkpoint.manifest_path(target))
    weights = checkpoint.load(out / "rank0.h5")["weights"]
    assert all(torch.equal(state["model"]["full_precision"][k], v) for k, v in weights.items())
