"""Asynchronous saves: a snapshot taken at the call, written in the background; errors never lost; exit waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ort_trainer import checkpoint
from tests.builders import mlp_trainer
from tests.models import mlp_batches
from tests.paths import REPO


def _flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in state["model"]["full_precision"].items()}
    for name, entry in state["optimizer"].items():
        out.update({f"optimizer/{name}/{k}": torch.as_tensor(v) for k, v in entry.items()})
    return out


def test_async_save_writes_the_state_of_the_call_while_training_goes_on(tmp_path):
    trainer = mlp_trainer(hidden=4096)  # ~100k parameters: big tensors go through the reused snapshot buffer
    batches = mlp_batches(6)
    trainer.train_step(*batches[0])
    expected = _flat(trainer.state_dict())
    handle = trainer.save_checkpoint(tmp_path / "a.ortcp", user_dict={"note": "first"}, async_save=True)
    assert isinstance(handle, checkpoint.io.SaveHandle)
    for batch in batches[1:4]:  # the live buffers change while the file is written
        trainer.train_step(*batch)
    assert handle.wait() == [str(tmp_path / "a.ortcp")]
    saved = checkpoint.load(tmp_path / "a.ortcp")
    got = _flat(saved)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert saved["train_step_info"]["step"] == 1
    assert checkpoint.decode_user_dict(saved["user_dict"]) == {"note": "first"}
    # the second save reuses the snapshot buffer: same memory, no new allocation
    snapshot = trainer.trainer_state.checkpoint_io.writer.snapshot
    pointer, size = snapshot._buffer.data_ptr(), snapshot.nbytes
    state_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert state_bytes * 0.95 <= size <= state_bytes * 1.05
    second = trainer.save_checkpoint(tmp_path / "b.ortcp", async_save=True)
    trainer.train_step(*batches[4])
    second.wait()
    assert snapshot._buffer.data_ptr() == pointer
    resumed = mlp_trainer(hidden=4096)
    resumed.load_checkpoint(tmp_path / "b.ortcp")
    resumed.train_step(*batches[4])
    trainer_state, resumed_state = _flat(trainer.state_dict()), _flat(resumed.state_dict())
    assert all(torch.equal(trainer_state[k], resumed_state[k]) for k in trainer_state)


def test_the_next_update_waits_for_the_weights_to_be_copied(tmp_path, monkeypatch):
    """Weights and moments are copied on the writer's thread while the next forward/backward runs; the
    optimizer update must not change them before that copy is done (here the copy is made slow)."""
    real_copy = checkpoint.io._snapshot._copy
    monkeypatch.setattr(checkpoint.io._snapshot, "_copy", lambda pairs: (time.sleep(0.5), real_copy(pairs)))
    trainer = mlp_trainer(hidden=4096)
    batches = mlp_batches(3)
    trainer.train_step(*batches[0])
    expected = _flat(trainer.state_dict())
    started = time.perf_counter()
    handle = trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True)
    assert time.perf_counter() - started < 0.4  # the call did not wait for the (slow) copy of the weights
    trainer.train_step(*batches[1])  # its update waits for the copy
    trainer.train_step(*batches[2])
    handle.wait()
    got = _flat(checkpoint.load(tmp_path / "a.ortcp"))
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(_flat(trainer.state_dict())["model/fc1.weight"], expected["model/fc1.weight"])


def test_the_next_save_waits_for_the_previous_one_and_legacy_positional_arguments_work(tmp_path):
    trainer = mlp_trainer()
    trainer.train_step(*mlp_batches(1)[0])
    first = trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True)
    trainer.save_checkpoint(tmp_path / "b.ortcp", {"epoch": 2}, True, True)  # legacy positional arguments
    assert first.done()  # the synchronous save waited for the asynchronous one
    assert checkpoint.decode_user_dict(checkpoint.load(tmp_path / "b.ortcp", key="user_dict")) == {"epoch": 2}
    with pytest.raises(checkpoint.CheckpointExistsError, match=r"a\.ortcp already exists"):
        trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True)  # refused at the call, not later
    trainer.save_checkpoint(tmp_path / "missing" / "c.ortcp", async_save=True).wait()  # the folder is created
    assert (tmp_path / "missing" / "c.ortcp").is_file()


def _failing_writes(monkeypatch) -> None:
    def disk_full(tree, path, *, overwrite=False):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint.io._scheduler, "save_to_checked_target", disk_full)


def test_a_background_failure_is_raised_by_the_next_call_once(tmp_path, monkeypatch):
    trainer = mlp_trainer()
    batch = mlp_batches(1)[0]
    trainer.train_step(*batch)
    _failing_writes(monkeypatch)
    handle = trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True)
    trainer.trainer_state.checkpoint_io.writer._thread.join()  # let it fail
    with pytest.raises(OSError, match="No space left on device"):
        trainer.train_step(*batch)
    trainer.train_step(*batch)  # reported once: training goes on
    assert trainer.train_step_info.step == 2
    assert isinstance(handle.error, OSError) and not (tmp_path / "a.ortcp").exists()
    handle = trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True)
    with pytest.raises(OSError, match="No space left on device"):  # the next save waits, then raises it
        trainer.save_checkpoint(tmp_path / "b.ortcp", async_save=True)
    monkeypatch.undo()
    trainer.save_checkpoint(tmp_path / "a.ortcp", async_save=True).wait()  # healthy again once space is back
    assert checkpoint.load(tmp_path / "a.ortcp", key="train_step_info") == {
        "optimization_step": 2,
        "step": 2,
        "seed": 0,
    }


LOG_FORMAT = 'import logging\nlogging.basicConfig(format="REC %(name)s %(levelname)s %(message)s")\n'
EXIT_SCRIPT = """
import sys, time, torch
from ort_trainer import ORTTrainer, optim
from ort_trainer.checkpoint.io import _scheduler
from tests.models import MLP, MLP_DESC, mlp_batches
real_save = _scheduler.save_to_checked_target
def slow_save(tree, path, *, overwrite=False):  # still running when the script ends
    time.sleep(0.5)
    if "fail" in str(path):
        raise OSError(28, "No space left on device", str(path))
    real_save(tree, path, overwrite=overwrite)
_scheduler.save_to_checked_target = slow_save
for path in sys.argv[1:]:
    trainer = ORTTrainer(MLP(hidden=4096), MLP_DESC, optim.AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    trainer.train_step(*mlp_batches(1)[0])
    trainer.save_checkpoint(path, async_save=True)
print("returned", flush=True)   # the script ends here, with both saves still running
"""


@pytest.mark.processes
def test_process_exit_waits_for_unfinished_saves_and_reports_a_failure_nobody_saw(tmp_path):
    ok, failing = tmp_path / "exit.ortcp", tmp_path / "fail.ortcp"
    result = subprocess.run(
        [sys.executable, "-c", LOG_FORMAT + textwrap.dedent(EXIT_SCRIPT), str(ok), str(failing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "returned" in result.stdout, result.stderr
    info = checkpoint.load(ok, key="train_step_info")
    assert info == {"optimization_step": 1, "step": 1, "seed": info["seed"]}
    assert not failing.exists()
    assert f"the asynchronous save of {failing} failed" in result.stderr, result.stderr
    # reported as a log record of the ort_trainer logger (ERROR), not printed
    assert f"REC ort_trainer.checkpoint.io._async ERROR ort_trainer: the asynchronous save of {failing}" in (
        result.stderr
    ), result.stderr
    assert "No space left on device" in result.stderr and str(ok) not in result.stderr
