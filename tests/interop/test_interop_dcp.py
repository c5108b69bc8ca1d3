"""``torch.distributed.checkpoint`` with the trainer as a ``Stateful``, resumed in a fresh process into a fresh,
unbuilt trainer: bit-identical to the uninterrupted run (LR schedule, gradient accumulation, Adam moments)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ort_trainer import checkpoint
from tests.paths import REPO
from tests.trees import assert_trees_equal

pytestmark = pytest.mark.processes  # every test here starts other processes


def test_dcp_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    for phase in ("first", "resume"):
        cmd = [sys.executable, "-m", "tests.interop.dcp_worker", phase, str(tmp_path)]
        done = subprocess.run(cmd, cwd=REPO, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    full, first, resumed = (checkpoint.load(tmp_path / f"{name}.h5") for name in ("full", "first", "resumed"))
    assert torch.equal(torch.cat([first.pop("losses"), resumed.pop("losses")]), full.pop("losses"))
    assert resumed["train_step_info"] == {"optimization_step": 5, "step": 10, "seed": 0}  # the saved run's
    assert_trees_equal(resumed, full)
