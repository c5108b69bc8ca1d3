"""A custom loop (plain module, AdamW, cosine schedule, GradScaler, dropout, its own sampler) killed with SIGKILL
while it trains and saves asynchronously, then started again: it restores the newest complete checkpoint and
ends with the weights and Adam moments of the run that never stopped, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ort_trainer import checkpoint
from tests.paths import REPO
from tests.trees import assert_trees_equal

pytestmark = [pytest.mark.processes, pytest.mark.faults]

_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint.custom_loop_worker", *args],
        cwd=REPO, env=_ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_custom_loop_killed_with_sigkill_resumes_bit_exactly(tmp_path):
    run = tmp_path / "run"
    _run(str(tmp_path / "none"), str(tmp_path / "reference.ortcp"), "--no-checkpoints")
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.custom_loop_worker", str(run), str(tmp_path / "killed.ortcp"),
         "--slow"],
        cwd=REPO, env=_ENV, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in worker.stdout:
            if line.strip() == "step 7":
                worker.send_signal(signal.SIGKILL)
                break
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed.ortcp").exists()
    out = _run(str(run), str(tmp_path / "resumed.ortcp"))
    start = int(out.split()[1])
    assert start in (4, 6), out  # the newest complete save when it was killed
    assert_trees_equal(checkpoint.load(tmp_path / "resumed.ortcp"), checkpoint.load(tmp_path / "reference.ortcp"))
