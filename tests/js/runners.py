"""The JS driver from the tests' side: write a training plan (js/tools/plan.js: plan.json and
batches.safetensors), run it on an artifact in onnxruntime-node or in headless Chromium (js/tools/run-*.mjs), and
the same plan in Python onnxruntime through ``ort_trainer.ArtifactRunner`` (the reference driver)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from ort_trainer import ArtifactRunner
from tests.paths import REPO

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
    timeout: float = 300,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the plan in ``runtime`` ("node" or "browser"), the driver's draws seeded with ``seed``; returns
    (result.json's dict, the saved state's tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    command = ["node", str(NODE_TOOLS / f"run-{runtime}.mjs"), str(artifact), str(plan), str(out), "--seed", str(seed)]
    if state is not None:
        command += ["--state", str(state)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "CHROMIUM": CHROMIUM}
    )
    if done.returncode != 0:
        raise AssertionError(f"{runtime} run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads((out / "result.json").read_text()), load_file(str(out / "state.safetensors"))


def run_python(
    artifact: Path, batches: list[dict], lrs: list[float], eval_batch: dict | None, state: Path | None = None
) -> tuple[dict, dict[str, np.ndarray]]:
    """The plan in Python onnxruntime (1 thread) through ``ort_trainer.ArtifactRunner``, the reference driver;
    returns what `run_js` returns (the random inputs of a batch fed as its draws)."""
    runner = ArtifactRunner(artifact, threads=1, state=state)
    random = {e["name"] for e in runner.manifest["random"]}
    losses = []
    for batch, lr in zip(batches, lrs, strict=True):
        draws = {n: v for n, v in batch.items() if n in random} or None
        losses.append(runner.train_step({n: v for n, v in batch.items() if n not in random}, lr, random=draws))
    evaluated = None if eval_batch is None else float(runner.eval_step(eval_batch)["loss"])
    return {"losses": losses, "eval_loss": evaluated, "step": runner.step}, dict(runner.state)


def compare(result: dict, state: dict, reference: dict, reference_state: dict, tolerance: float) -> float:
    """Assert a JS run equal to the reference run within ``tolerance``: step count, every loss, the eval loss and
    every state tensor (names, dtypes, shapes, values); returns the largest difference seen."""
    assert result["step"] == reference["step"]
    losses = np.array(result["losses"])
    assert losses.shape == (len(reference["losses"]),) and np.all(np.isfinite(losses)), losses
    worst = float(np.abs(losses - reference["losses"]).max())
    worst = max(worst, abs(result["eval_loss"] - reference["eval_loss"]))
    assert set(state) == set(reference_state)
    for name, value in reference_state.items():
        assert state[name].dtype == value.dtype and state[name].shape == value.shape, name
        worst = max(worst, float(np.abs(state[name].astype(np.float64) - value).max()))
    assert worst <= tolerance, f"largest difference {worst} > {tolerance}"
    return worst
