"""A child forked from a process that trains frees its inherited trainer without hanging (stock onnxruntime 1.31:
freeing an ONNX Runtime session in a fork child blocked forever in ``pthread_cond_destroy`` on the parent's
thread-pool state; `runtime._fork_safety` keeps inherited sessions alive in the child instead).

This child leaves through ``os._exit``; children that exit normally (``sys.exit``, where ONNX Runtime's C++
static destructors blocked the same way) are tests/engine/test_fork_exit.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.paths import REPO

pytestmark = [pytest.mark.processes, pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")]

CHILD_FREES_THE_TRAINER = textwrap.dedent(
    """
    import gc, os, sys, time
    from tests.builders import mlp_trainer
    from tests.models import mlp_batches

    trainer = mlp_trainer()
    trainer.train_step(*mlp_batches(1)[0])
    pid = os.fork()
    if pid == 0:
        del trainer
        gc.collect()  # the inherited sessions would be freed here
        os._exit(7)
    deadline = time.time() + 60
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("exit code", os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        print("the child hung")
    """
)


def test_a_forked_child_frees_its_inherited_trainer_without_hanging():
    done = subprocess.run(
        [sys.executable, "-c", CHILD_FREES_THE_TRAINER],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exit code 7" in done.stdout, done.stdout + done.stderr[-2000:]
