"""The checkpoint tool starts without torch and ONNX Runtime for the commands that do not need them.

``inspect``, ``verify``, ``diff`` (of checkpoint files), ``--help`` and ``--version`` run on h5py and
numpy alone, so they start in a fraction of torch's import time (figures in docs/cli.md). Each command
runs in a fresh interpreter that reports which heavy modules got imported; the property is checked,
not a time. ``convert`` to ``.pt`` needs torch and does import it (so the probe can tell).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint import cli
from tests.paths import LEGACY_CHECKPOINT
from tests.rank_states import full_state, save_ranks

HEAVY = ("torch", "onnxruntime", "onnx", "transformers", "safetensors", "fsspec")

PROBE = f"""
import sys
from ort_trainer.checkpoint.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:  # --help and --version leave through argparse
    code = exit_.code
heavy = [m for m in {HEAVY!r} if m in sys.modules]
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _probe(*args, cwd) -> tuple[int, str, list[str]]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    line = next(line for line in run.stderr.splitlines() if line.startswith("HEAVY="))
    heavy = [m for m in line.removeprefix("HEAVY=").split(",") if m]
    return run.returncode, run.stdout + run.stderr, heavy


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_startup")
    state = full_state("AdamOptimizer")
    state["user_dict"] = C.encode_user_dict(state["user_dict"])
    C.save(state, root / "a.ortcp")
    state["model"]["full_precision"]["w1"] = state["model"]["full_precision"]["w1"] + 1
    C.save(state, root / "b.ortcp")
    half = {"model": {"full_precision": {"h": torch.randn(3, 2).to(torch.bfloat16)}}}  # a dtype numpy lacks
    C.save(half, root / "half.ortcp")
    paths = save_ranks(C.reshard_state(state, 2, zero_stage=1, run_id="run-2"), root)
    C.write_manifest(C.manifest_path(root / "set.ortcp"), paths, world_size=2, step=16, run_id="run-2")
    return root


@pytest.mark.parametrize(
    ("args", "code", "expect"),
    [
        (["--help"], 0, "inspect"),
        (["--version"], 0, "ort_trainer"),
        (["inspect", "a.ortcp"], 0, "train_step_info: optimization_step="),
        (["inspect", "half.ortcp"], 0, "bfloat16"),
        (["inspect", "--json", "set.ortcp.manifest.json"], 0, '"world_size": 2'),
        (["inspect", LEGACY_CHECKPOINT], 0, "legacy"),
        (["verify", "a.ortcp", "b.ortcp", "half.ortcp"], 0, "everything intact"),
        (["verify", "set.ortcp.manifest.json"], 0, "pieces tile their tensors"),
        (["diff", "a.ortcp", "b.ortcp", "--atol", "0.5"], 1, "tensor differs: model/full_precision/w1"),
        (["diff", "a.ortcp", "a.ortcp"], 0, "are equal"),
        (["diff", "a.ortcp", "b.ortcp", "--atol", "abc"], 2, "argument --atol: expected a number >= 0"),
    ],
    ids=lambda v: " ".join(map(str, v)) if isinstance(v, list) else None,
)
def test_read_only_commands_import_neither_torch_nor_onnxruntime(files, args, code, expect):
    returncode, output, heavy = _probe(*args, cwd=files)
    assert returncode == code, output
    assert expect in output, output
    assert heavy == [], f"{args} imported {heavy}"


def test_the_probe_sees_torch_where_a_command_needs_it(files, tmp_path):
    returncode, output, heavy = _probe("convert", "a.ortcp", "-o", tmp_path / "a.pt", cwd=files)
    assert returncode == 0, output
    assert "torch" in heavy and torch.load(tmp_path / "a.pt", weights_only=True)["w1"].shape == (16, 14)


def test_diff_of_bfloat16_values_is_numeric(tmp_path, capsys):
    """bfloat16 has no numpy dtype: diff reads it through torch and widens it exactly (in-process: torch is here)."""
    a = {"model": {"full_precision": {"h": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)}}}
    b = {"model": {"full_precision": {"h": torch.tensor([1.0, 2.0, 3.5], dtype=torch.bfloat16)}}}
    C.save(a, tmp_path / "a.ortcp")
    C.save(b, tmp_path / "b.ortcp")
    assert cli.main(["diff", str(tmp_path / "a.ortcp"), str(tmp_path / "b.ortcp")]) == 1
    assert "max abs diff 0.5 (1 of 3 elements differ)" in capsys.readouterr().out
    assert cli.main(["diff", str(tmp_path / "a.ortcp"), str(tmp_path / "b.ortcp"), "--atol", "0.5"]) == 0
    assert "are equal" in capsys.readouterr().out


def test_debug_keeps_the_documented_exit_status(files):
    returncode, output, _ = _probe("--debug", "inspect", "missing.ortcp", cwd=files)
    assert returncode == 2, output
    assert "Traceback (most recent call last)" in output and "ort-trainer-ckpt: error: missing.ortcp" in output


def test_convert_without_safetensors_says_how_to_install_it(files, tmp_path, monkeypatch, capsys):
    """The hint names what an index has: `safetensors` (no index has "ort_trainer[safetensors]")."""
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert cli.main(["convert", str(files / "a.ortcp"), "-o", str(tmp_path / "a.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install safetensors" in err, err
    assert "ort_trainer[safetensors]" not in err and not (tmp_path / "a.safetensors").exists()


def test_saving_a_numpy_tree_imports_no_torch(tmp_path):
    """``checkpoint.save`` of numpy/python values never pays torch's import (a forked saver's first save
    used to import it, seconds under load)."""
    code = f"""
import sys
import numpy as np
from ort_trainer import checkpoint
path = {str(tmp_path / "t.ortcp")!r}
checkpoint.save({{"w": np.ones(3, np.float32), "meta": {{"step": 1, "name": "x", "tags": [1, 2]}}}}, path)
print("HEAVY=" + ",".join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stderr.splitlines() if line.startswith("HEAVY="))
    assert line == "HEAVY=", line
