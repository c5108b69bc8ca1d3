"""A child forked from a process that trains, which trains itself and then exits normally (``sys.exit``, the end
of the program, a ``multiprocessing`` worker's return), exits with its own status, its stdout and the files it
wrote flushed (issue S5, item 7). With stock onnxruntime 1.31 such a child blocked forever in ONNX Runtime's C++
static destructors (``pthread_cond_destroy`` on a condition variable a thread of the parent waited on at the
fork; a plain ``import onnxruntime`` is enough); the children run in tests/engine/fork_exit_children.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import pytest
import torch

from ort_trainer import checkpoint
from tests.paths import REPO

pytestmark = [pytest.mark.processes, pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")]


def test_forked_children_that_train_exit_normally_with_their_code_and_their_output(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.fork_exit_children", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    report = json.loads(line)
    codes = {kind: child["code"] for kind, child in report.items()}
    assert codes == {"trainer-sys-exit": 0, "trainer-falls-off": 0, "exit-code": 5, "ortmodule": 0, "mp-fork": 0}, (
        report,
        done.stderr[-3000:],
    )
    for kind in ("trainer-sys-exit", "trainer-falls-off", "exit-code"):
        assert report[kind]["stdout"].startswith(f"{kind} losses ["), report[kind]
    assert report["ortmodule"]["stdout"] == "ortmodule trained\n"
    expected = checkpoint.load(tmp_path / "trainer-sys-exit.ortcp")
    assert (tmp_path / "exit-code.txt").read_text() == "exit-code wrote this\n"
    with h5py.File(tmp_path / "exit-code.h5", "r") as f:
        assert f["steps"].shape == (0,)
    for kind in ("trainer-sys-exit", "trainer-falls-off", "mp-fork"):
        assert (tmp_path / f"{kind}.txt").read_text() == f"{kind} wrote this\n"
        if kind != "mp-fork":
            with h5py.File(tmp_path / f"{kind}.h5", "r") as f:
                assert f["steps"][()].tolist() == [0, 1, 2], kind
        loaded = checkpoint.load(tmp_path / f"{kind}.ortcp")  # the same three steps from the same seed
        torch.testing.assert_close(loaded["model"], expected["model"], rtol=0, atol=0)
