"""The distributed save protocol (checkpoint/io/_set_writer.py) with threads as ranks: styles, refusals, failures.

A thread-backed all-gather (tests/checkpoint/thread_ranks.py) stands in for the process group, so every branch
(a rank failing to write, rank 0 failing to publish, leftovers of killed saves) runs in milliseconds;
tests/distributed/test_distributed.py and tests/checkpoint/test_checkpoint_set_kills.py run the same code over
gloo in real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ort_trainer import checkpoint
from ort_trainer.checkpoint.io import _set_writer as _writer
from ort_trainer.checkpoint.io import resolve
from tests.checkpoint.thread_ranks import ok, save

pytestmark = pytest.mark.processes  # every test here starts other processes


def test_shared_path_replaces_the_old_set_and_removes_leftovers_of_killed_saves(tmp_path):
    path = tmp_path / "ckpt.ortcp"
    ok(save(path, 1.0))
    first = checkpoint.read_manifest(checkpoint.manifest_path(path))
    (tmp_path / "ckpt.rank1-of-2.deadbeef.ortcp").write_bytes(b"a killed save's rank file")
    (tmp_path / "ckpt.rank0-of-2.ortcp").write_bytes(b"a set from before save ids, not listed")
    (tmp_path / "ckpt.rank1-of-2.notes.ortcp").write_bytes(b"not ours: not a save id")
    ok(save(path, 2.0))
    second = checkpoint.check_manifest(checkpoint.manifest_path(path))
    assert second.run_id != first.run_id and second.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt.ortcp.manifest.json", "ckpt.rank1-of-2.notes.ortcp", *(e.name for e in second.files)]
    )
    state = checkpoint.aggregate_checkpoints(checkpoint.manifest_path(path))
    assert state["train_step_info"]["step"] == 2 and float(state["model"]["full_precision"]["w"][0]) == 2.0


def test_refusals_are_the_same_on_every_rank_and_nothing_is_written(tmp_path):
    results = save([tmp_path / "a.ortcp", tmp_path / "a.ortcp", tmp_path / "b.ortcp"], 1.0, world=3)
    assert all(
        isinstance(r, ValueError) and "same path on some ranks and different paths on others" in str(r) for r in results
    ), results
    ok(save(tmp_path / "s.ortcp", 1.0))
    results = save(tmp_path / "s.ortcp", 2.0, overwrite=False)
    assert all(
        isinstance(r, checkpoint.CheckpointExistsError) and "s.ortcp.manifest.json already exists" in str(r)
        for r in results
    ), results
    ok(save([tmp_path / "r0.ortcp", tmp_path / "r1.ortcp"], 1.0))
    results = save([tmp_path / "r0.ortcp", tmp_path / "r1.ortcp"], 2.0, overwrite=False)
    assert all(isinstance(r, checkpoint.CheckpointExistsError) and "rank 1: " in str(r) for r in results), results
    (tmp_path / "blocker").write_text("")  # a missing folder is created (tests/checkpoint/test_missing_folders.py)
    results = save(tmp_path / "blocker" / "x.ortcp", 1.0)
    assert all(isinstance(r, FileNotFoundError) and "could not create the folder" in str(r) for r in results), results
    assert not list(tmp_path.glob("b*.ortcp"))


def test_a_rank_failing_to_write_fails_the_save_everywhere_and_keeps_the_previous_set(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.ortcp"
    ok(save(path, 1.0))
    before = sorted(p.name for p in tmp_path.iterdir())
    real = _writer.write_file

    def rank1_disk_full(tree, target, **kwargs):
        if ".rank1-of-2." in target.name:
            raise OSError(28, "No space left on device", target.display)
        return real(tree, target, **kwargs)

    monkeypatch.setattr(_writer, "write_file", rank1_disk_full)
    results = save(path, 2.0)
    assert isinstance(results[1], OSError) and "No space left" in str(results[1])
    assert isinstance(results[0], checkpoint.CheckpointError), results[0]
    assert "rank(s) [1] failed to write their file" in str(results[0]) and "previous set is intact" in str(results[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # rank 0's new file was removed again
    assert checkpoint.check_manifest(checkpoint.manifest_path(path)).step == 1


def test_rank0_failing_to_publish_the_manifest_fails_everywhere_and_removes_the_new_files(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.ortcp"
    ok(save(path, 1.0))
    before = sorted(p.name for p in tmp_path.iterdir())

    def broken(plan, reports, step):
        raise OSError(5, "Input/output error", plan.manifest.display)

    monkeypatch.setattr(_writer, "_publish_manifest", broken)
    results = save(path, 2.0)
    assert isinstance(results[0], OSError)
    assert isinstance(results[1], checkpoint.CheckpointError) and "rank 0 failed to write the manifest" in str(
        results[1]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert checkpoint.check_manifest(checkpoint.manifest_path(path)).step == 1


def test_one_path_per_rank_writes_exactly_those_files(tmp_path):
    paths = [tmp_path / "ckpt_rank0.ortcp", tmp_path / "ckpt_rank1.ortcp"]
    results = ok(save(paths, 3.0))
    assert results == [[str(paths[0])], [str(paths[1])]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_rank0.ortcp", "ckpt_rank1.ortcp"]
    assert checkpoint.aggregate_checkpoints(paths[::-1])["train_step_info"]["step"] == 3


def test_a_set_on_object_storage(tmp_path):
    url = "memory://sets/run/ckpt.ortcp"
    ok(save(url, 1.0))
    ok(save(url, 2.0))
    fs = resolve(url).fs
    names = sorted(Path(p).name for p in fs.ls("/sets/run", detail=False))
    manifest = fs.cat_file("/sets/run/ckpt.ortcp.manifest.json").decode()
    assert len(names) == 3 and all(name in manifest for name in names if name.endswith(".ortcp")), names
    with checkpoint.io.local_inputs(url + ".manifest.json") as local:
        assert checkpoint.aggregate_checkpoints(local)["train_step_info"]["step"] == 2
