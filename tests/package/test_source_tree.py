"""``import ort_trainer`` from a source checkout takes ``checkpoint``, ``optim`` and ``amp`` from the same checkout,
even where another checkout of the project is installed in editable mode (its finder maps those three names to
its own folders: a second worktree run with ``PYTHONPATH=<worktree>`` used to get the trainer from the worktree
and the checkpoint package from the installed checkout)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.paths import REPO


def test_the_mapped_subpackages_come_from_the_checkout_the_package_came_from(tmp_path):
    code = (
        "import ort_trainer, ort_trainer.checkpoint, ort_trainer.optim, ort_trainer.amp\n"
        "for m in (ort_trainer, ort_trainer.checkpoint, ort_trainer.optim, ort_trainer.amp): print(m.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-3000:]
    files = run.stdout.split()
    expected = [
        REPO / "ort_trainer" / "__init__.py",
        *(REPO / sub / "__init__.py" for sub in ("checkpoint", "optim", "amp")),
    ]
    assert [os.path.realpath(f) for f in files] == [os.path.realpath(p) for p in expected]
