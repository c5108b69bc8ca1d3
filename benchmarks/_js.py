"""The JS driver (js/) from Python: write a training plan (js/tools/plan.js: plan.json and batches.safetensors) and
run it on an artifact in onnxruntime-node or in onnxruntime-web inside headless Chromium (js/tools/run-*.mjs).
``benchmarks/anywhere_js.py`` times it; tests/js checks its numbers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
JS = REPO / "js"
NODE_TOOLS = JS / "tools"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def write_plan(folder: Path, batches: list[dict[str, np.ndarray]], lrs: list[float], eval_batch: dict | None) -> Path:
    """One batch per step (random inputs included where the plan feeds its own draws) and the eval batch."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"{i}/{name}": np.ascontiguousarray(v) for i, b in enumerate(batches) for name, v in b.items()}
    plan: dict = {"steps": [{"lr": lr, "batch": str(i)} for i, lr in enumerate(lrs)]}
    if eval_batch is not None:
        tensors.update({f"e/{name}": np.ascontiguousarray(v) for name, v in eval_batch.items()})
        plan["eval"] = "e"
    save_file(tensors, str(folder / "batches.safetensors"))
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder


def run_js(
    runtime: str,
    artifact: Path,
    plan: Path,
    out: Path,
    state: Path | None = None,
    seed: int = 0,
    threads: int = 1,
    timeout: float = 600,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the plan in ``runtime`` ("node" or "browser"), the driver's draws seeded with ``seed``, ``threads``
    intra-op threads; returns (result.json's dict: losses, step_ms, step_cpu_ms (node), eval_loss, step,
    runtime, the saved state's tensors). Raises RuntimeError with the runner's output when it fails."""
    out.mkdir(parents=True, exist_ok=True)
    command = ["node", str(NODE_TOOLS / f"run-{runtime}.mjs"), str(artifact), str(plan), str(out)]
    command += ["--seed", str(seed), "--threads", str(threads)]
    if state is not None:
        command += ["--state", str(state)]
    env = {**os.environ, "CHROMIUM": CHROMIUM}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{runtime} run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads((out / "result.json").read_text()), load_file(str(out / "state.safetensors"))
