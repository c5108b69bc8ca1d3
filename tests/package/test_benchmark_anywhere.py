"""``benchmarks/anywhere.py`` runs, shortened (the MLP, one round): its table has both contenders, its --json their
numbers, and --keep leaves the artifact and the timed batch for the JS driver's timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import safetensors.numpy

from tests.paths import REPO


@pytest.mark.processes
def test_anywhere_benchmark_times_both_contenders_and_keeps_the_artifact_for_other_runtimes(tmp_path):
    out, keep = tmp_path / "anywhere.json", tmp_path / "keep"
    command = [sys.executable, str(REPO / "benchmarks" / "anywhere.py"), "--models", "mlp", "--rounds", "1"]
    command += ["--steps", "1", "--json", str(out), "--keep", str(keep)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "command: " in result.stdout and "artifact (onnxruntime)" in result.stdout, result.stdout
    numbers = json.loads(out.read_text())["results"]["mlp"]
    assert set(numbers) == {"ORTTrainer.train_step", "artifact (onnxruntime)"}
    assert all(ms > 0 for ms in numbers.values())
    manifest = json.loads((keep / "mlp" / "artifact" / "manifest.json").read_text())
    batch = safetensors.numpy.load_file(str(keep / "mlp" / "batch.safetensors"))
    assert sorted(batch) == sorted(e["name"] for e in manifest["inputs"])
