"""``benchmarks/anywhere_js.py`` runs, shortened (the MLP, 4 steps): the host stamp and the table, and from its
--json every runtime timed every step and trained as Python onnxruntime did."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.paths import REPO


def test_the_benchmark_times_python_node_and_the_browser_on_one_artifact(tmp_path):
    out = tmp_path / "anywhere_js.json"
    command = [sys.executable, str(REPO / "benchmarks" / "anywhere_js.py"), "--models", "mlp", "--steps", "4"]
    done = subprocess.run([*command, "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith("host: ") and "command: " in done.stdout, done.stdout
    assert "| mlp | 0.81M | onnxruntime-web 1.30.0 (wasm, 1 thread) |" in done.stdout, done.stdout
    [entry] = json.loads(out.read_text())["report"]
    runtimes = entry["runtimes"]
    assert list(runtimes) == ["python", "node", "browser"]
    for name, r in runtimes.items():
        assert len(r["step_ms"]) == 4 and all(ms > 0 for ms in r["step_ms"]), (name, r)
        assert r["wall_ms"] > 0 and r["cpu_ms"] is not None and r["cpu_ms"] >= 0, (name, r)
    assert runtimes["node"]["max_loss_difference"] <= 1e-6, runtimes
    assert runtimes["browser"]["max_loss_difference"] <= 1e-4, runtimes
