"""A process that forks while a checkpoint is saved in the background (issue 32, item 1).

The writer thread has the HDF5 file open, and that temporary file is the inode that gets published. Before
the fix, a child forked meanwhile flushed HDF5's stale in-memory state into the published checkpoint when it
exited normally or opened the same checkpoint: after ``wait()`` and the parent's own load had succeeded, the
file failed to load (``HDF5 metadata checksum mismatch``, ``file is N bytes but was written with M``), also
with ``overwrite=True`` (no good copy left). A child forked during any save must never change a byte of a
published file, and a child that loads the checkpoint must read exactly what the parent reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

pytestmark = [pytest.mark.processes, pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")]


def _run(out, *args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint.fork_saver", str(out), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_untouched(result: dict) -> None:
    phase = result["phase"]
    assert result["after"] == result["before"], f"{phase}: a forked child changed the published checkpoint"
    assert result["parent"] == result["parent_before"], f"{phase}: the checkpoint no longer loads: {result['parent']}"
    for kind, got in result["children"].items():
        assert got == result["parent_before"], f"{phase}: the {kind} child read something else: {got}"


def test_children_forked_at_every_phase_of_an_async_save_never_touch_the_published_file(tmp_path):
    """Forks while the writer is held at its first dataset, halfway, and just before HDF5 closes the
    file; per phase one child exits normally, one loads (os.fork), one multiprocessing worker loads."""
    results = _run(tmp_path, "held")
    assert [r["phase"] for r in results] == ["first-dataset", "halfway", "before-close"]
    for result in results:
        assert result["exit_codes"] == [0], result
        _assert_untouched(result)


@pytest.mark.faults
def test_free_forks_during_async_saves_never_touch_the_published_file(tmp_path):
    """Up to 16 forks per save while it runs, nothing held; children exit normally or load (~1 min)."""
    (result,) = _run(tmp_path, "free", "3")
    assert result["forks"] > 0
    assert result["after"] == result["before"], "a forked child changed the published checkpoint"
    assert all(got == result["parent"] for got in result["children"]), result["children"]
    assert not result["parent"].startswith("error"), result["parent"]
