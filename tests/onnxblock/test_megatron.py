"""Megatron (horizontal parallel) training on local gloo ranks, against one process on the whole batch.

Every run is `tests/onnxblock/megatron_worker.py`: the reference runs it as one process, the
parallel runs as D x H ranks; each writes its losses and full weights (slices joined) for comparison.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ort_trainer import checkpoint
from tests.paths import REPO
from tests.ranks import run_ranks

TOL = 1e-5
WORKER = ["-m", "tests.onnxblock.megatron_worker"]


def run(world: int, out: Path, *args) -> dict:
    run_ranks(world, [*WORKER, "--out", str(out), *map(str, args)])
    return checkpoint.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run of an argument list, run once per module: the parallel runs of several tests (GPT-2 on
    h=2 and on 2x2, BERT on worlds 2 and 4) compare with the same deterministic reference."""
    runs: dict[tuple[str, ...], dict] = {}

    def get(*args) -> dict:
        key = tuple(map(str, args))
        if key not in runs:
            runs[key] = run(1, tmp_path_factory.mktemp("reference") / "ref.h5", *args)
        return runs[key]

    return get


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_run(result: dict, reference: dict, steps: int | None = None) -> None:
    losses = reference["losses"][-steps:] if steps else reference["losses"]
    assert result["losses"].shape == losses.shape
    assert float((result["losses"] - losses).abs().max()) < TOL, (result["losses"], losses)
    assert max_diff(result["weights"], reference["weights"]) < TOL
    if not steps and "eval" in reference:  # the same weights give the same eval loss on the last batch
        assert float((result["eval"] - reference["eval"]).abs().max()) < TOL


@pytest.mark.processes
def test_mlp_h2_then_h4_with_checkpoints(tmp_path):
    """h=2 for 5 steps, saved to one shared path; h=4 loads that set and trains 5 more, saving one file per rank."""
    ref10 = run(1, tmp_path / "ref10.h5", "--model", "mlp", "--steps", 10)
    shared = tmp_path / "h2.ortcp"
    first = run(2, tmp_path / "h2.h5", "--model", "mlp", "--h", 2, "--steps", 5, "--save", shared)
    assert_same_run(first, {"losses": ref10["losses"][:5], "weights": first["weights"]})
    assert max_diff(first["weights"], ref10["weights"]) > 1e-3  # it trains on after step 5
    manifest = f"{shared}.manifest.json"
    full = checkpoint.aggregate_checkpoints(manifest)
    assert max_diff(full["model"]["full_precision"], first["weights"]) == 0.0  # the slices, joined
    assert tuple(full["optimizer"]["fc1.weight"]["Moment_1"].shape) == (16, 20)

    per_rank = tmp_path / "h4_{rank}.ortcp"
    second = run(4, tmp_path / "h4.h5", "--model", "mlp", "--h", 4, "--start", 5, "--steps", 5, "--load", manifest,
                 "--save", per_rank)  # fmt: skip
    assert_same_run(second, ref10, steps=5)
    files = [str(per_rank).format(rank=r) for r in range(4)]
    rank0 = checkpoint.load(files[0])
    assert rank0["partition_info"]["fc1.weight"]["original_dim"] == [16, 20]
    assert rank0["partition_info"]["fc1.weight"]["megatron_row_partition"] == [1]  # torch Linear: outputs on axis 0
    assert rank0["partition_info"]["fc2.weight"]["megatron_row_partition"] == [0]
    assert tuple(rank0["model"]["full_precision"]["fc1.weight"].shape) == (4, 20)
    merged = tmp_path / "merged.ortcp"
    cli = [sys.executable, "-m", "ort_trainer.checkpoint"]
    subprocess.run([*cli, "aggregate", *files, "-o", str(merged)], check=True, cwd=REPO, capture_output=True)
    assert max_diff(checkpoint.load(merged)["model"]["full_precision"], ref10["weights"]) < TOL
    shown = subprocess.run([*cli, "inspect", files[1]], check=True, cwd=REPO, capture_output=True, text=True).stdout
    assert "fc1.weight  full (16, 20)  Megatron row (axis 0)  slice 1 stored (4, 20)" in shown


@pytest.mark.processes
def test_mlp_2x2_zero1_accumulation(tmp_path):
    """World 4: 2 data-parallel replicas x 2 horizontal slices, ZeRO stage 1, two micro-steps per update."""
    args = ("--model", "mlp", "--steps", 10, "--accumulation", 2)
    reference = run(1, tmp_path / "ref.h5", *args)
    assert_same_run(run(4, tmp_path / "grid.h5", *args, "--h", 2, "--zero", 1), reference)


@pytest.mark.processes
def test_gpt2_h2(tmp_path, reference):
    args = ("--model", "gpt2", "--steps", 10, "--eps", 1e-4)
    assert_same_run(run(2, tmp_path / "h2.h5", *args, "--h", 2), reference(*args))


@pytest.mark.faults
@pytest.mark.processes
def test_gpt2_2x2_zero1(tmp_path, reference):
    args = ("--model", "gpt2", "--steps", 10, "--eps", 1e-4)
    assert_same_run(run(4, tmp_path / "grid.h5", *args, "--h", 2, "--zero", 1), reference(*args))


@pytest.mark.faults
@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 4])
def test_bert(tmp_path, reference, world):
    args = ("--model", "bert", "--steps", 10, "--eps", 1e-4)
    assert_same_run(run(world, tmp_path / "par.h5", *args, "--h", 2, "--zero", 1), reference(*args))


@pytest.mark.faults
@pytest.mark.processes
def test_gpt2_checkpoints_between_one_process_and_h2(tmp_path):
    """Fused Q|K|V slices save with our partition_info stride, aggregate and load both ways."""
    args = ("--model", "gpt2", "--sgd")
    reference = run(1, tmp_path / "ref.h5", *args, "--steps", 6)
    single, shared = tmp_path / "single.ortcp", tmp_path / "h2.ortcp"
    run(1, tmp_path / "first.h5", *args, "--steps", 3, "--save", single)
    first = run(2, tmp_path / "h2.h5", *args, "--h", 2, "--steps", 3, "--save", shared)
    manifest = f"{shared}.manifest.json"
    full = checkpoint.aggregate_checkpoints(manifest)["model"]["full_precision"]
    assert max_diff(full, {k: first["weights"][k] for k in full}) == 0.0
    into_one = run(1, tmp_path / "one.h5", *args, "--start", 3, "--steps", 3, "--load", manifest)
    assert_same_run(into_one, reference, steps=3)
    into_h2 = run(2, tmp_path / "two.h5", *args, "--h", 2, "--start", 3, "--steps", 3, "--load", single)
    assert_same_run(into_h2, reference, steps=3)
