"""Processes that watch a training run while a ``keep_last=1`` manager prunes it (issue 32, item 6).

Before the fix a watcher (``CheckpointManager(dir).latest()`` + ``checkpoint.load``, or ``restore``) got
``CheckpointCorruptError`` when the file it read was pruned: the index scan re-opened the file by name to
read string records (``FileNotFoundError`` became "damaged or truncated"), and ``restore`` gave up with
"no checkpoint ... could be restored" when its candidates vanished, though a newer checkpoint was there
(57 reports in 9 s). A file pruned once it is open still reads (it is open); one pruned before is
``CheckpointNotFoundError``; ``restore`` rescans and loads the newest checkpoint there is.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointManager
from ort_trainer.checkpoint.format import _h5_reader
from tests.builders import mlp_trainer
from tests.models import mlp_batches
from tests.paths import REPO

BATCHES = mlp_batches(8)


def _trained(steps: int):
    trainer = mlp_trainer()
    for batch in BATCHES[:steps]:
        trainer.train_step(*batch)
    return trainer


def test_a_checkpoint_removed_right_after_it_was_opened_still_loads(tmp_path, monkeypatch):
    """The file is unlinked between HDF5's open and the index scan (which reads string records)."""
    path = tmp_path / "ckpt.ortcp"
    trainer = _trained(1)
    trainer.save_checkpoint(path)
    expected = checkpoint.load(path)
    real_open = _h5_reader.open_h5

    def open_then_prune(p, verify):
        opened = real_open(p, verify)
        os.unlink(p)  # a manager pruned it: the name is gone, the open file is whole
        return opened

    monkeypatch.setattr(_h5_reader, "open_h5", open_then_prune)
    got = checkpoint.load(path)
    assert got["train_step_info"] == expected["train_step_info"]
    assert got["trainer_options"]["optimizer_name"] == expected["trainer_options"]["optimizer_name"]
    assert torch.equal(got["model"]["full_precision"]["fc1.weight"], expected["model"]["full_precision"]["fc1.weight"])


def test_a_trainer_loads_a_checkpoint_removed_right_after_it_was_opened(tmp_path, monkeypatch):
    """``trainer.load_checkpoint`` (what ``restore`` calls) opens the file once: a prune after that open
    cannot make the load fail (it had peeked at the file's topology, closed it, and opened the name again)."""
    path = tmp_path / "ckpt.ortcp"
    trainer = _trained(2)
    trainer.save_checkpoint(path)
    real_open = _h5_reader.open_h5
    opens: list[str] = []

    def open_then_prune(p, verify):
        opened = real_open(p, verify)
        opens.append(str(p))
        os.unlink(p)  # a keep_last=1 manager pruned it: the name is gone, the open file is whole
        return opened

    monkeypatch.setattr(_h5_reader, "open_h5", open_then_prune)
    watcher = mlp_trainer(seed=3)
    watcher.load_checkpoint(path)
    assert len(opens) == 1
    got, want = watcher.state_dict(pytorch_format=True), trainer.state_dict(pytorch_format=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert watcher.train_step_info.optimization_step == trainer.train_step_info.optimization_step


def test_a_checkpoint_removed_before_it_was_opened_is_not_found(tmp_path):
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="ckpt.ortcp"):
        checkpoint.load(tmp_path / "ckpt.ortcp")


class _PrunedWhileRestoring:
    """The watcher's trainer: before its first load, the training run saves a newer step and its
    ``keep_last=1`` manager prunes every checkpoint the watcher's restore had listed."""

    def __init__(self, watcher: Any, run_manager: CheckpointManager, run_trainer: Any, step: int) -> None:
        self._watcher, self._run_manager, self._run_trainer, self._step = watcher, run_manager, run_trainer, step
        self.loads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._watcher, name)

    def load_checkpoint(self, path: Any, **kwargs: Any) -> dict:
        if not self.loads:
            self._run_trainer.train_step(*BATCHES[self._step - 1])
            self._run_trainer.train_step(*BATCHES[self._step])
            self._run_manager.save(self._run_trainer)
        self.loads.append(str(path))
        return self._watcher.load_checkpoint(path, **kwargs)


def test_restore_rescans_when_its_candidates_are_pruned(tmp_path, caplog):
    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_last=1)
    trainer = _trained(2)
    manager.save(trainer)
    watcher = _PrunedWhileRestoring(mlp_trainer(seed=3), manager, trainer, 3)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    restored = CheckpointManager(run).restore(watcher)
    assert restored is not None and restored.step == 4
    assert [os.path.basename(p) for p in watcher.loads] == ["ckpt-000000002.ortcp", "ckpt-000000004.ortcp"]
    got, want = watcher._watcher.state_dict(pytorch_format=True), trainer.state_dict(pytorch_format=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


WRITER = """
import sys, time
from ort_trainer import checkpoint
from tests.builders import mlp_trainer
from tests.models import mlp_batches
folder, seconds = sys.argv[1], float(sys.argv[2])
trainer = mlp_trainer(hidden=256)
manager = checkpoint.CheckpointManager(folder, keep_last=1)
batches, end, count = mlp_batches(4), time.time() + seconds, 0
while time.time() < end:
    trainer.train_step(*batches[count % 4])
    manager.save(trainer)
    count += 1
print(count, flush=True)
"""


@pytest.mark.faults
@pytest.mark.processes
def test_watchers_of_a_keep_last_1_run_never_see_corruption(tmp_path):
    """12 s of ``latest()`` + load and ``restore()`` while another process saves and prunes every step."""
    run = tmp_path / "run"
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(run), "12"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher = mlp_trainer(hidden=256)
    outcomes: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    while writer.poll() is None:
        for kind in ("latest", "restore"):
            try:
                if kind == "latest":
                    info = CheckpointManager(run).latest()
                    loaded = info is not None and checkpoint.load(info.path)
                else:
                    loaded = CheckpointManager(run).restore(watcher)
                outcomes[f"{kind} ok" if loaded else "empty"] += 1
            except checkpoint.CheckpointError as exc:
                outcomes[f"{kind} {type(exc).__name__}"] += 1
                examples.setdefault(f"{kind} {type(exc).__name__}", str(exc)[:400])
        time.sleep(0.001)
    out, err = writer.communicate()
    assert writer.returncode == 0, err[-3000:]
    print("saves:", out.strip(), "outcomes:", dict(outcomes))
    allowed = {"latest ok", "restore ok", "empty", "latest CheckpointNotFoundError"}
    assert set(outcomes) <= allowed, examples
    assert outcomes["latest ok"] > 20 and outcomes["restore ok"] > 20, outcomes
