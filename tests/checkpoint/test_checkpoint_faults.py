"""Faults around saves, readers, the manager and URLs (issue 24): each test reproduces one failure found by
fault injection, deterministically where the fault can be placed at one point of the code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zlib

import h5py
import numpy as np
import pytest
import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointManager
from ort_trainer.checkpoint.format import _atomic, _tempfile
from tests.builders import mlp_trainer
from tests.models import mlp_batches
from tests.paths import REPO

BATCHES = mlp_batches(4)
TREE = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}


def _run(script: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=timeout, env=env
    )


def _in_thread(fn, seconds: float = 60.0):
    """Run ``fn`` on a daemon thread; return (finished, result or exception)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(seconds)
    return (not thread.is_alive()), (box[0] if box else None)


def _outcome(fn):
    try:
        return fn()
    except BaseException as exc:
        return exc


# ---------------------------------------------------------------- 1. good checkpoints reported as corrupt
def test_a_reader_opening_the_file_right_after_it_is_published_reads_it(tmp_path, monkeypatch):
    """The save's lock on its temporary file must be gone once the file has its final name."""
    path = tmp_path / "ck.ortcp"
    checkpoint.save({"old": 1}, path)
    seen = []
    real_publish = _atomic.publish

    def publish_then_read(tmp, target, overwrite):
        real_publish(tmp, target, overwrite)
        seen.append(checkpoint.load(target))  # another reader, before the save has returned

    monkeypatch.setattr(_atomic, "publish", publish_then_read)
    checkpoint.save(TREE, path, overwrite=True)
    assert torch.equal(seen[0]["w"], TREE["w"]) and seen[0]["step"] == 3


def test_a_child_forked_during_a_save_does_not_keep_the_checkpoint_locked(tmp_path, monkeypatch):
    """A DataLoader worker forked while a save runs inherits its descriptors (and so its lock)."""
    path = tmp_path / "ck.ortcp"
    real_init = _tempfile.LockedTempFile.__init__
    children = []

    def lock_and_fork(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        pid = os.fork()
        if pid == 0:  # the child only sleeps, holding every descriptor it inherited
            time.sleep(20)
            os._exit(0)
        children.append(pid)

    monkeypatch.setattr(_tempfile.LockedTempFile, "__init__", lock_and_fork)
    try:
        checkpoint.save(TREE, path)
        assert torch.equal(checkpoint.load(path)["w"], TREE["w"])  # while the child lives
    finally:
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_a_checkpoint_removed_while_it_is_opened_is_not_found_not_corrupt(tmp_path, monkeypatch):
    path = tmp_path / "ck.ortcp"
    checkpoint.save(TREE, path)
    real_file = h5py.File

    def pruned_first(name, mode="r", *args, **kwargs):
        if isinstance(name, str | os.PathLike) and os.fspath(name) == os.fspath(path) and mode == "r":
            os.unlink(path)  # a manager prunes it between the checks and HDF5's open
        return real_file(name, mode, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", pruned_first)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="removed") as info:
        checkpoint.load(path)
    assert isinstance(info.value, FileNotFoundError)


def test_a_checkpoint_replaced_while_it_is_opened_gives_the_new_file(tmp_path, monkeypatch):
    path = tmp_path / "ck.ortcp"
    checkpoint.save({"w": torch.zeros(100), "step": 1}, path)
    real_file = h5py.File
    replaced = []

    def replaced_first(name, mode="r", *args, **kwargs):
        if isinstance(name, str | os.PathLike) and os.fspath(name) == os.fspath(path) and not replaced:
            replaced.append(True)
            monkeypatch.setattr(h5py, "File", real_file)  # the save below writes through HDF5 too
            checkpoint.save({"w": torch.ones(7), "step": 2}, path, overwrite=True)
            monkeypatch.setattr(h5py, "File", replaced_first)
        return real_file(name, mode, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", replaced_first)
    loaded = checkpoint.load(path)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.ones(7))


# ---------------------------------------------------------------- 2. async save from an atexit hook
@pytest.mark.processes
def test_an_async_save_started_at_exit_completes(tmp_path):
    path = tmp_path / "exit.ortcp"
    result = _run(
        f"""
        import atexit
        from tests.builders import mlp_trainer
        from tests.models import mlp_batches
        trainer = mlp_trainer(hidden=512)
        trainer.train_step(*mlp_batches(1)[0])
        atexit.register(lambda: trainer.save_checkpoint({str(path)!r}, async_save=True))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = checkpoint.load(path)
    assert saved["train_step_info"]["step"] == 1


# ---------------------------------------------------------------- 3. saving a lower step
def test_saving_a_lower_step_is_refused_and_deletes_nothing(tmp_path):
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(trainer, 10)
    with pytest.raises(ValueError, match=r"cannot save step 5 .* already holds checkpoint step 10"):
        manager.save(trainer, 5)
    assert [info.step for info in manager.checkpoints()] == [10]
    manager.save(trainer, 10)  # the same step again (overwrite) is allowed
    manager.save(trainer, 11)
    assert [info.step for info in manager.checkpoints()] == [11]


# ---------------------------------------------------------------- 4. glob characters in a remote URL
@pytest.mark.parametrize("name", ["run?1", "run*", "run[1]"])
def test_a_remote_url_with_glob_characters_is_saved_at_that_exact_key(name):
    import fsspec  # a dependency of the remote paths: missing, this test fails

    fs = fsspec.filesystem("memory")
    folder = f"memory://faults-{zlib.crc32(name.encode())}/{name}"
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    try:
        trainer.save_checkpoint(f"{folder}/ck.ortcp")
        assert fs.isfile(f"{folder}/ck.ortcp"), fs.find(folder.rsplit("/", 1)[0])
        manager = CheckpointManager(folder, keep_last=1)
        manager.save(trainer, 1)
        manager.save(trainer, 2)
        assert [info.step for info in manager.checkpoints()] == [2]
        assert manager.restore(mlp_trainer()).step == 2
        leftovers = [p for p in fs.find(folder) if ".tmp-" in p]
        assert leftovers == []
    finally:
        fs.rm(folder.split("/")[2], recursive=True)


# ---------------------------------------------------------------- 5. a save thread that cannot start
def test_a_save_thread_that_cannot_start_leaves_the_trainer_usable(tmp_path, monkeypatch):
    trainer = mlp_trainer(hidden=4096)  # large tensors: the snapshot defers their copy to the save thread
    trainer.train_step(*BATCHES[0])

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True)
    finished, result = _in_thread(lambda: trainer.train_step(*BATCHES[1]), 60)
    assert finished, "train_step blocked after a save whose thread could not start"
    assert isinstance(result, torch.Tensor), result
    trainer.save_checkpoint(tmp_path / "b.ortcp", async_save=True).wait()
    assert checkpoint.load(tmp_path / "b.ortcp")["train_step_info"]["step"] == 2


# ---------------------------------------------------------------- 6. file:// URLs
def test_file_urls_name_local_absolute_paths_and_other_hosts_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError, match=r"names the host 'runs'.*'runs/ck.ortcp'"):
        checkpoint.io.resolve("file://runs/ck.ortcp")
    with pytest.raises(ValueError, match="names the host 'otherhost'"):
        checkpoint.io.resolve("file://otherhost/data/ck.ortcp")
    assert checkpoint.io.resolve(f"file://localhost{tmp_path}/a.ortcp").path == tmp_path / "a.ortcp"
    assert checkpoint.io.resolve(f"file://{tmp_path}/b%20c.ortcp").path == tmp_path / "b c.ortcp"
    trainer = mlp_trainer()
    with pytest.raises(ValueError, match="names the host 'runs'"):
        trainer.save_checkpoint("file://runs/ck.ortcp")
    assert not (tmp_path / "runs" / "ck.ortcp").exists()


# ---------------------------------------------------------------- 8. the low ones
def test_a_step_beyond_the_names_of_the_manager_is_refused(tmp_path):
    trainer = mlp_trainer()
    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(ValueError, match=r"step must be at most 999999999999999999 \(18 digits"):
        manager.save(trainer, 10**18)
    manager.save(trainer, 10**18 - 1)
    assert [info.step for info in manager.checkpoints()] == [10**18 - 1]


def test_a_fifo_at_a_checkpoint_path_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "ck.ortcp"
    os.mkfifo(fifo)
    try:
        finished, result = _in_thread(lambda: checkpoint.load(fifo), 20)
        assert finished, "load blocked on a FIFO"
        assert isinstance(result, checkpoint.CheckpointFormatError) and "not a regular file" in str(result)
        run = tmp_path / "run"
        run.mkdir()
        os.mkfifo(run / "ckpt-000000003.ortcp")
        manager = CheckpointManager(run)

        def restore():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return manager.restore(mlp_trainer())

        finished, result = _in_thread(restore, 60)
        assert finished, "restore blocked on a FIFO"
        assert isinstance(result, checkpoint.CheckpointCorruptError) and "not a regular file" in str(result)
    finally:
        for stuck in (fifo, tmp_path / "run" / "ckpt-000000003.ortcp"):  # free a thread still blocked
            if stuck.exists():
                fd = os.open(stuck, os.O_RDWR | os.O_NONBLOCK)
                os.close(fd)


@pytest.mark.processes
def test_a_pruning_failure_after_the_last_manager_call_is_reported_at_exit(tmp_path):
    result = _run(
        f"""
        import torch
        from ort_trainer import ORTTrainer, optim
        from ort_trainer.checkpoint import CheckpointManager
        from ort_trainer.checkpoint.manager import _manager
        from tests.models import MLP, MLP_DESC

        def refuse(directory, step):
            raise PermissionError(13, "read-only bucket", str(step))

        _manager.remove_checkpoint = refuse
        trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(lr=0.01),
                             loss_fn=torch.nn.functional.cross_entropy)
        manager = CheckpointManager({str(tmp_path / "run")!r}, keep_last=1, async_save=True)
        manager.save(trainer, 1)
        manager.save(trainer, 2)  # its pruning of step 1 fails in the background; no call follows
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the pruning of" in result.stderr and "read-only bucket" in result.stderr, result.stderr[-3000:]


def test_manager_wait_raises_a_failed_save_once(tmp_path, monkeypatch):
    trainer = mlp_trainer()
    manager = CheckpointManager(tmp_path / "run", async_save=True)

    def full_disk(tmp, path, overwrite):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_atomic, "publish", full_disk)
    manager.save(trainer, 1)
    with pytest.raises(checkpoint.CheckpointWriteError, match="no space left"):
        manager.wait()
    manager.wait()  # reported already: not raised again
    trainer.wait_for_checkpoint()
    monkeypatch.undo()
    manager.save(trainer, 2).wait()
    assert [info.step for info in manager.checkpoints()] == [2]


def test_an_async_save_to_a_relative_path_ignores_a_later_chdir(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    real_copy = checkpoint.io._snapshot._copy
    monkeypatch.setattr(checkpoint.io._snapshot, "_copy", lambda pairs: (time.sleep(0.5), real_copy(pairs)))
    trainer = mlp_trainer(hidden=4096)
    trainer.train_step(*BATCHES[0])
    monkeypatch.chdir(first)
    handle = trainer.save_checkpoint("ck.ortcp", async_save=True)
    os.chdir(second)  # while the background thread has not written anything yet
    handle.wait()
    assert (first / "ck.ortcp").is_file() and not (second / "ck.ortcp").exists()


def test_a_root_attribute_of_the_wrong_type_is_a_checkpoint_error_naming_it(tmp_path):
    path = tmp_path / "ck.ortcp"
    checkpoint.save(TREE, path)
    with h5py.File(path, "r+") as f:
        f.attrs["ort_trainer.format_version"] = np.array([2, 2])
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"attribute ort_trainer.format_version is ndarray"):
        checkpoint.load(path, verify=False)
    with pytest.raises(checkpoint.CheckpointCorruptError):  # the header's metadata checksum sees the edit first
        checkpoint.load(path)


@pytest.mark.parametrize(
    "hostile",
    [
        '{"format": "ort_trainer.checkpoint.index", "format_version": 1, "checkpoints": '
        '[{"step": 1, "name": "ckpt-000000001.ortcp", "metrics": {}, "time": 1' + "0" * 400 + "}]}",
        '{"format": "ort_trainer.checkpoint.index", "format_version": 1, "checkpoints": '
        '[{"step": 1, "name": "ckpt-000000001.ortcp", "metrics": {"loss": 1' + "0" * 400 + '}, "time": 1.0}]}',
        "[" * 100_000 + "]" * 100_000,
        '{"format": "ort_trainer.checkpoint.index", "format_version": 1' + "0" * 5000 + ', "checkpoints": []}',
    ],
    ids=["huge-time", "huge-metric", "deep", "long-int"],
)
def test_hostile_index_values_are_checkpoint_errors(tmp_path, hostile):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ort_trainer_checkpoints.json").write_text(hostile)
    with pytest.raises(checkpoint.CheckpointFormatError, match="ort_trainer_checkpoints.json"):
        CheckpointManager(run).checkpoints()


def _manifest(tmp_path):
    files = []
    for rank in range(2):
        files.append(tmp_path / f"ck.rank{rank}-of-2.ortcp")
        checkpoint.save({"rank": rank}, files[-1])
    path = tmp_path / "ck.ortcp.manifest.json"
    checkpoint.write_manifest(path, files, world_size=2, step=7, run_id="abc")
    return path


def test_every_field_of_a_manifest_is_covered_by_its_checksum(tmp_path):
    path = _manifest(tmp_path)
    assert checkpoint.read_manifest(path).step == 7
    doc = json.loads(path.read_text())
    for field, value in (("step", 8), ("run_id", "abd"), ("world_size", 2)):
        edited = {**doc, field: value}
        path.write_text(json.dumps(edited))
        if value == doc[field]:
            assert checkpoint.read_manifest(path).step == 7
            continue
        with pytest.raises(checkpoint.CheckpointCorruptError, match="manifest checksum mismatch"):
            checkpoint.read_manifest(path)
    # a manifest written before the checksum (format version 1) still loads
    old = {k: v for k, v in doc.items() if k != "checksum"}
    path.write_text(json.dumps({**old, "format_version": 1}))
    assert checkpoint.check_manifest(path).step == 7


@pytest.mark.parametrize("hostile", ["[" * 100_000 + "]" * 100_000, '{"format": 1' + "0" * 5000 + "}"])
def test_hostile_manifest_values_are_checkpoint_errors(tmp_path, hostile):
    path = tmp_path / "ck.ortcp.manifest.json"
    path.write_text(hostile)
    with pytest.raises(checkpoint.CheckpointFormatError, match="manifest"):
        checkpoint.read_manifest(path)


def test_a_set_pruned_while_its_manifest_is_checked_is_not_found(tmp_path, monkeypatch):
    path = _manifest(tmp_path)
    real_crc = checkpoint.sets._manifest.file_crc32

    def pruned_meanwhile(file):
        if path.exists():  # the manager removes the manifest first, then the rank files
            path.unlink()
            for rank_file in tmp_path.glob("ck.rank*"):
                rank_file.unlink()
        return real_crc(file)

    monkeypatch.setattr(checkpoint.sets._manifest, "file_crc32", pruned_meanwhile)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="removed while it was checked"):
        checkpoint.check_manifest(path)
