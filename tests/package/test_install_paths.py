"""The install paths, from clean virtual environments and the real package index (`make test-install`).

* stock only: `pip install .` in a fresh venv brings the stock onnxruntime (and no onnxruntime-training);
* training only: where onnxruntime-training is installed, `pip install .` brings no second runtime, and the onnx
  it reads (1.17), not the newest;
* switching: a second runtime installed over the first mixes their files (the `onnxruntime` folder is shared),
  the trainer refuses that with the repair, and the repair (uninstall both, install one) leaves exactly one
  runtime whose files are all its own.

Resolution is checked with ``pip install --dry-run --report`` (what pip would install, without the multi-GB torch
download); the runtimes themselves are installed for real, with ``--no-deps``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.paths import REPO

pytestmark = [pytest.mark.install, pytest.mark.processes]

TRAINING = "onnxruntime-training==1.19.2"
STOCK = "onnxruntime==1.31.1"


def _run(*command: str | Path, env: dict | None = None) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _venv(root: Path) -> Path:
    _run(sys.executable, "-m", "venv", root)
    return root / "bin" / "python"


def _would_install(python: Path, tmp_path: Path) -> dict[str, str]:
    """What ``pip install <this repository>`` would install into ``python``'s environment: name -> version."""
    report = tmp_path / "report.json"
    _run(python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", report, REPO)
    return {
        i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }


def _runtime_check(python: Path) -> str:
    """The trainer's own check (`ort_trainer._package.runtimes`), run in that environment: 'ok' or its message."""
    script = "from ort_trainer._package.runtimes import runtime_conflict as c; print(c() or 'ok')"
    return _run(python, "-c", script, env={**os.environ, "PYTHONPATH": str(REPO)}).strip()


def _files_not_its_own(python: Path, distribution: str) -> list[str]:
    """Files of ``distribution`` whose bytes differ from its RECORD: what another package overwrote."""
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (info,) = purelib.glob(f"{distribution.replace('-', '_')}-*.dist-info")
    changed = []
    with open(info / "RECORD", newline="") as record:
        for path, digest, _size in csv.reader(record):
            if not digest:
                continue
            algorithm, want = digest.split("=", 1)
            data = (purelib / path).read_bytes() if (purelib / path).exists() else b""
            got = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()
            if got != want:
                changed.append(path)
    return changed


def test_a_fresh_venv_gets_the_stock_runtime(tmp_path):
    python = _venv(tmp_path / "venv")
    planned = _would_install(python, tmp_path)
    assert "onnxruntime" in planned and "onnxruntime-training" not in planned, planned
    assert planned["onnxruntime"] in SpecifierSet(">=1.31,<2"), planned["onnxruntime"]
    assert planned["onnxscript"] in SpecifierSet(">=0.7.2,<0.8") and planned["onnx"] in SpecifierSet(">=1.17,<2")
    assert {"torch", "numpy", "h5py", "crc32c", "ort-trainer"} <= set(planned), planned


@pytest.fixture(scope="module")
def training_venv(tmp_path_factory) -> Path:
    python = _venv(tmp_path_factory.mktemp("training") / "venv")
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", TRAINING)
    return python


def test_where_onnxruntime_training_is_installed_no_second_runtime_comes_and_onnx_fits_it(training_venv, tmp_path):
    planned = _would_install(training_venv, tmp_path)
    assert "onnxruntime" not in planned and "onnxruntime-training" not in planned, planned
    assert planned["onnx"].startswith("1.17."), f"onnxruntime-training 1.19.2 rejects newer onnx: {planned['onnx']}"
    assert _runtime_check(training_venv) == "ok"


def test_switching_runtimes_is_refused_until_repaired_as_the_message_says(training_venv):
    _run(training_venv, "-m", "pip", "install", "--quiet", "--no-deps", STOCK)  # over onnxruntime-training
    message = _runtime_check(training_venv)
    assert "installed over each other (onnxruntime 1.31.1, onnxruntime-training 1.19.2)" in message, message
    assert _files_not_its_own(training_venv, "onnxruntime-training"), "the stock wheel overwrote none of its files?"
    repair = "pip uninstall -y onnxruntime onnxruntime-training"
    assert repair in message
    _run(training_venv, "-m", *repair.split())
    _run(training_venv, "-m", "pip", "install", "--quiet", "--no-deps", TRAINING)
    assert _runtime_check(training_venv) == "ok"
    assert _files_not_its_own(training_venv, "onnxruntime-training") == []
