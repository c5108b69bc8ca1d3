"""The JS driver from the tests' side: plans written and run in node or headless Chromium (`benchmarks._js`), the same
plan in Python onnxruntime through ``ort_trainer.ArtifactRunner`` (the reference driver), and the comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks._js import JS, NODE_TOOLS, run_js, write_plan
from ort_trainer import ArtifactRunner

__all__ = ["JS", "NODE_TOOLS", "compare", "run_js", "run_python", "write_plan"]


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
