"""The JS driver on artifacts written by ``ort_trainer.export_training``: an MLP (AdamW) and a tiny GPT-2 with
Dropout on (AdamW, clipping), 20 steps on batches of changing size with the plan's own Dropout draws, in
onnxruntime-node (within 1e-6 of ``ort_trainer.ArtifactRunner`` in Python onnxruntime) and in onnxruntime-web in
headless Chromium (within 1e-4)."""

from __future__ import annotations

import pytest

from tests.js.exported import export_gpt2, export_mlp, gpt2_plan, mlp_plan
from tests.js.runners import compare, run_js, run_python, write_plan

MODELS = {"mlp": (export_mlp, mlp_plan), "gpt2": (export_gpt2, gpt2_plan)}
RUNTIMES = {"node": 1e-6, "browser": 1e-4}


@pytest.fixture(scope="module", params=sorted(MODELS))
def exported(request, tmp_path_factory):
    """(artifact, plan folder, the reference run, its final state): exported once per model."""
    export, plan_of = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    artifact = export(root / "artifact")
    batches, lrs, eval_batch = plan_of(artifact)
    plan = write_plan(root / "plan", batches, lrs, eval_batch)
    return artifact, plan, *run_python(artifact, batches, lrs, eval_batch)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_twenty_steps_equal_the_python_driver(exported, runtime, tmp_path, record_property):
    artifact, plan, reference, reference_state = exported
    result, state = run_js(runtime, artifact, plan, tmp_path)
    worst = compare(result, state, reference, reference_state, RUNTIMES[runtime])
    record_property("max_difference", worst)
    record_property("runtime", result["runtime"])
