"""``benchmarks/varlen.py`` runs, shortened: a tiny GPT-2 on batches that transformers' collator padded to several
lengths (the last batch smaller), ORTTrainer and ORTModule beside eager PyTorch. From its --json: each built one
graph per mode for every shape, and both trained as PyTorch did at every step.

ORTModule runs as ``ortmodule_marked`` (its inputs' dims marked with ``torch._dynamo.mark_dynamic``): unmarked,
Dynamo's first graph has the first call's static shapes, and it compiles a symbolic one when the length first
changes and another when the batch size does (3 forward and backward pairs, ~25 s each at GPT-2 small: the
benchmark's table and docs/engines.md, "Variable-length batches"), which would triple this test's time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

CONTENDERS = ("pytorch", "ort_trainer", "ortmodule_marked")


@pytest.mark.processes
def test_ort_trainer_and_ortmodule_build_one_graph_per_mode_and_train_as_pytorch(tmp_path):
    out = tmp_path / "varlen.json"
    command = [sys.executable, str(REPO / "benchmarks" / "varlen.py"), "--model", "gpt2-tiny", "--steps", "5"]
    command += ["--contenders", ",".join(CONTENDERS), "--sections", "speed", "--json", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "| ort_trainer |" in result.stdout and "command: " in result.stdout, result.stdout
    report = json.loads(out.read_text())

    shapes = [tuple(s) for s in report["shapes"]]
    assert len(set(shapes)) >= 3 and len({b for b, _ in shapes}) == 2, shapes  # lengths vary; the last batch is smaller
    speed = report["speed"]
    assert speed["ort_trainer"]["builds"] == {"training graph": 1}, speed["ort_trainer"]["build_events"]
    assert speed["ortmodule_marked"]["builds"] == {"forward": 1, "backward": 1}, speed["ortmodule_marked"]
    assert speed["ortmodule_marked"]["dynamo_graphs"] == 1
    for name in ("ort_trainer", "ortmodule_marked"):
        assert report["summary"][name]["goals"]["builds"], report["summary"][name]
    reference = speed["pytorch"]["losses"]
    assert len(reference) == len(shapes)
    for name in ("ort_trainer", "ortmodule_marked"):
        losses = speed[name]["losses"]
        assert len(losses) == len(reference), name
        for step, (ours, theirs) in enumerate(zip(losses, reference, strict=True)):
            assert abs(ours - theirs) <= 1e-4, f"{name} step {step} ({shapes[step]}): {ours} vs pytorch {theirs}"


@pytest.mark.processes
def test_varlen_memory_splits_ort_trainer_s_rss_into_phases_and_a_cache_hit_skips_the_export(tmp_path):
    """``benchmarks/varlen_memory.py``, shortened: a cold build grows RSS at the export, a build whose graph the
    cache holds does not (the exporter is never imported), and every variant reports a peak against PyTorch's."""
    out = tmp_path / "memory.json"
    command = [sys.executable, str(REPO / "benchmarks" / "varlen_memory.py"), "--model", "gpt2-tiny", "--steps", "2"]
    command += ["--variants", "pytorch_sdpa,cold,hit", "--json", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "| cold |" in result.stdout and "command: " in result.stdout, result.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"pytorch_sdpa", "cold", "hit"}
    for name in ("cold", "hit"):
        phases = results[name]["phases"]
        expected = ["setup", "store", "traced", "exported", "graph", "session", "first step", "steps"]
        assert list(phases) == expected, phases  # a tiny model traces and exports in the process
        assert results[name]["peak"] >= max(phases.values()), results[name]
    cold, hit = results["cold"]["phases"], results["hit"]["phases"]
    assert cold["exported"] - cold["traced"] >= 20, cold  # the exporter's import and the export itself
    assert hit["exported"] - hit["traced"] <= 5, hit  # a cached graph: neither
    assert results["hit"]["peak"] < results["cold"]["peak"], results
