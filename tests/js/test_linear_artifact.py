"""The JS driver against a hand-written artifact (tests/js/linear_artifact.py): in onnxruntime-node and in
onnxruntime-web inside headless Chromium, 20 AdamW steps on batches of changing size equal the same plan run in
Python onnxruntime by manifest.json, and a state saved by the driver resumes where it stopped."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

from tests.js.linear_artifact import FEATURES, write_linear_artifact
from tests.js.runners import compare, run_js, run_python, write_plan

STEPS = 20


def _batches(seed: int, with_random: bool) -> tuple[list[dict], list[float], dict]:
    rng = np.random.default_rng(seed)
    true_w = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    batches = []
    for i in range(STEPS):
        n = (8, 5, 3, 8)[i % 4]  # one graph for every batch size
        x = rng.standard_normal((n, FEATURES)).astype(np.float32)
        batch = {"x": x, "y": (x @ true_w + 0.1).astype(np.float32)}
        if with_random:
            batch["random_0"] = rng.random((n, FEATURES), dtype=np.float32)
            batch["random_1"] = rng.standard_normal(n * FEATURES).astype(np.float32)
        batches.append(batch)
    lrs = [0.05 * (1 - i / (2 * STEPS)) for i in range(STEPS)]
    x = rng.standard_normal((6, FEATURES)).astype(np.float32)
    return batches, lrs, {"x": x, "y": (x @ true_w + 0.1).astype(np.float32)}


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    """The artifact, the plan (random inputs fed), and the Python reference run of it."""
    root = tmp_path_factory.mktemp("linear")
    artifact = write_linear_artifact(root / "artifact")
    batches, lrs, eval_batch = _batches(1, with_random=True)
    plan = write_plan(root / "plan", batches, lrs, eval_batch)
    reference, reference_state = run_python(artifact, batches, lrs, eval_batch)
    return artifact, plan, reference, reference_state


def test_node_runs_twenty_adamw_steps_as_python_does(linear, tmp_path, record_property):
    artifact, plan, reference, reference_state = linear
    result, state = run_js("node", artifact, plan, tmp_path / "node")
    losses = result["losses"]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) / 2, losses  # it learned
    worst = compare(result, state, reference, reference_state, 1e-6)
    record_property("node_vs_python_max_diff", worst)
    # the saved state carries the step for the next run
    with safe_open(str(tmp_path / "node" / "state.safetensors"), "np") as f:
        assert f.metadata() == {"format": "ort_trainer.training_artifact", "step": str(STEPS)}


def test_browser_runs_twenty_adamw_steps_as_python_does(linear, tmp_path, record_property):
    artifact, plan, reference, reference_state = linear
    result, state = run_js("browser", artifact, plan, tmp_path / "browser")
    assert result["runtime"].startswith("onnxruntime-web 1.30.0"), result["runtime"]
    worst = compare(result, state, reference, reference_state, 1e-4)
    record_property("browser_vs_python_max_diff", worst)


def test_a_saved_state_resumes_where_it_stopped_in_node_and_in_the_browser(linear, tmp_path):
    """10 steps, the state saved, then 10 more from the saved file: as the 20 straight steps of Python."""
    artifact, _, reference, reference_state = linear
    batches, lrs, eval_batch = _batches(1, with_random=True)
    first = write_plan(tmp_path / "first", batches[:10], lrs[:10], None)
    second = write_plan(tmp_path / "second", batches[10:], lrs[10:], eval_batch)
    half, _ = run_js("node", artifact, first, tmp_path / "half")
    assert half["step"] == 10
    saved = tmp_path / "half" / "state.safetensors"
    for runtime, tolerance in (("node", 1e-6), ("browser", 1e-4)):
        rest, state = run_js(runtime, artifact, second, tmp_path / runtime, state=saved)
        assert rest["step"] == STEPS
        np.testing.assert_allclose(half["losses"] + rest["losses"], reference["losses"], rtol=0, atol=tolerance)
        for name, value in reference_state.items():
            np.testing.assert_allclose(state[name], value, rtol=0, atol=tolerance, err_msg=name)


def test_random_inputs_are_drawn_by_the_driver_from_its_seed(linear, tmp_path):
    """Without fed draws the driver fills random_0 (uniform, [batch, 4]) and random_1 (normal, "batch*4") itself:
    the graph runs at every batch size, a seed gives the same run, another seed another run, and the run differs
    from the one with the plan's own draws."""
    artifact, _, reference, _ = linear
    batches, lrs, _ = _batches(1, with_random=False)
    plan = write_plan(tmp_path / "plan", batches, lrs, None)
    runs = [
        run_js("node", artifact, plan, tmp_path / f"run{i}", seed=seed)[0]["losses"] for i, seed in enumerate((0, 0, 1))
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0] != reference["losses"]
    assert all(np.isfinite(runs[0]))
