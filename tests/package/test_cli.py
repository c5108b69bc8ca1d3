"""The ``ort-trainer-ckpt`` console script: inspect, verify, aggregate, convert, diff and its error path.

Each CLI test runs the installed script in a subprocess (about 2 s each for importing torch), so
the checks are grouped into few runs; pure helpers and extra error cases run in-process.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint import cli
from ort_trainer.checkpoint.cli._diff import Difference, compare_tensors, format_diff
from tests.paths import LEGACY_CHECKPOINT as LEGACY
from tests.rank_states import assert_same, full_state, save_ranks

SCRIPT = Path(sys.executable).parent / "ort-trainer-ckpt"


def run(*args, module: bool = False) -> subprocess.CompletedProcess:
    """Run the real console script (or ``python -m ort_trainer.checkpoint``) with a non-TTY stdout/stderr."""
    exe = [sys.executable, "-m", "ort_trainer.checkpoint"] if module else [str(SCRIPT)]
    return subprocess.run([*exe, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def full(tmp_path):
    """A single-process checkpoint in the legacy tree layout, plus lr_scheduler/loss_scaler/user_dict."""
    state = full_state("AdamOptimizer")
    state["user_dict"] = C.encode_user_dict(state["user_dict"])
    C.save(state, tmp_path / "full.ortcp")
    return tmp_path / "full.ortcp", state


@pytest.fixture
def zero_set(tmp_path, full):
    """The same state as 3 ZeRO stage-1 rank files and their manifest."""
    states = C.reshard_state(full[1], 3, zero_stage=1, run_id="run-1")
    paths = save_ranks(states, tmp_path)
    manifest = C.manifest_path(tmp_path / "ckpt.ortcp")
    C.write_manifest(manifest, paths, world_size=3, step=16, run_id="run-1")
    return paths, manifest


@pytest.fixture
def evil_legacy(tmp_path):
    """The legacy fixture whose pickled user_dict would create ``marker`` if anything unpickled it."""
    path, marker = tmp_path / "legacy.ortcp", tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    shutil.copy(LEGACY, path)
    path.chmod(0o644)
    with h5py.File(path, "r+") as f:
        del f["user_dict"]
        f["user_dict"] = pickle.dumps({"epoch": Evil()}).hex().encode("ascii")
    return path, marker


def _flip_byte_inside(path: Path, tensor: torch.Tensor) -> None:
    data = bytearray(path.read_bytes())
    start = data.find(tensor.numpy().tobytes())
    assert start > 0 and data.find(tensor.numpy().tobytes(), start + 1) == -1
    data[start + 3] ^= 0x40
    path.write_bytes(bytes(data))


# ---- inspect ------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_inspect_text_lists_tree_options_step_info_and_user_dict(full):
    result = run("inspect", full[0])
    assert result.returncode == 0 and result.stderr == ""
    out = result.stdout
    assert "format version 2" in out
    assert "model/full_precision/w1" in out and "(16, 14)" in out and "float32" in out and " 896" in out
    assert "optimizer/w1/Update_Count" in out and "int64" in out
    assert "optimizer_name=AdamOptimizer" in out and "world_size=1" in out and "zero_stage=0" in out
    assert "train_step_info: optimization_step=8 step=16" in out
    assert "lr_scheduler: base_lr=0.001 last_step=8" in out and "loss_scaler: loss_scale=1024.0" in out
    assert "user_dict: keys ['epoch', 'note']" in out and "partitions: none" in out


@pytest.mark.processes
def test_inspect_json_of_a_rank_file_and_its_manifest(zero_set):
    paths, manifest = zero_set
    result = run("inspect", "--json", paths[1], manifest)
    assert result.returncode == 0, result.stderr
    rank1, summary = json.loads(result.stdout)
    assert rank1["kind"] == "checkpoint" and rank1["format_version"] == 2 and rank1["legacy"] is False
    assert rank1["trainer_options"]["world_rank"] == 1 and rank1["trainer_options"]["zero_stage"] == 1
    assert rank1["distributed"]["run_id"] == "run-1" and rank1["lr_scheduler"] == {"base_lr": 0.001, "last_step": 8}
    tree = {e["key"]: e for e in rank1["tree"]}
    assert tree["model/full_precision/w1"] == {
        "key": "model/full_precision/w1",
        "shape": [16, 14],
        "dtype": "float32",
        "nbytes": 896,
    }
    w1 = next(p for p in rank1["partitions"] if p["name"] == "w1")
    assert w1["original_dim"] == [16, 14] and w1["megatron_axis"] is None
    assert w1["range"] == [w1["offset"], w1["offset"] + w1["numel"]] and w1["stored_shape"] == [w1["numel"]]
    assert summary["kind"] == "manifest" and (summary["world_size"], summary["step"]) == (3, 16)
    assert [(f["rank"], f["name"], f["exists"]) for f in summary["files"]] == [
        (r, p.name, True) for r, p in enumerate(paths)
    ]
    pieces = next(p for p in summary["partitions"] if p["name"] == "w1")["pieces"]
    assert pieces[0]["range"][0] == 0 and pieces[-1]["range"][1] == 16 * 14  # the pieces tile w1
    assert all(a["range"][1] == b["range"][0] for a, b in zip(pieces, pieces[1:], strict=False))


@pytest.mark.processes
def test_inspect_legacy_file_reports_the_pickled_user_dict_without_unpickling(evil_legacy):
    path, marker = evil_legacy
    text = run("inspect", path)
    assert text.returncode == 0, text.stderr
    assert "legacy ORTTrainer checkpoint (format version 0, no checksums)" in text.stdout
    assert "user_dict: legacy pickled user_dict (not decoded)" in text.stdout
    assert "model/full_precision/fc1.weight" in text.stdout and "(16, 20)" in text.stdout
    doc = json.loads(run("inspect", "--json", path).stdout)
    assert doc["format_version"] == 0 and doc["legacy"] is True and doc["lr_scheduler"] is None
    assert doc["user_dict"]["encoding"] == "legacy_pickle"
    assert doc["user_dict"]["description"] == "legacy pickled user_dict (not decoded)"
    assert doc["trainer_options"]["optimizer_name"] == "AdamOptimizer" and doc["train_step_info"]["step"] == 8
    assert not marker.exists()  # nothing was unpickled


# ---- verify -------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_verify_intact_files_manifest_and_legacy_exit_0(full, zero_set):
    result = run("verify", full[0], zero_set[1], LEGACY)
    assert result.returncode == 0, result.stdout
    assert "FAIL" not in result.stdout and "verify: everything intact" in result.stdout
    assert "ranks 0..2 present once each" in result.stdout and "no checksums to verify" in result.stdout


@pytest.mark.processes
def test_verify_names_the_damaged_dataset_and_the_missing_rank(full, zero_set):
    path, state = full
    _flip_byte_inside(path, state["optimizer"]["w2"]["Moment_2"])
    paths, _ = zero_set
    result = run("verify", path, paths[0], paths[2])
    assert result.returncode == 1
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 2, result.stdout
    assert f"{path}: dataset 'optimizer/w2/Moment_2': checksum mismatch" in fails[0]
    assert "missing rank(s) [1] of world_size 3" in fails[1] and paths[0].name in fails[1]
    assert "verify: 2 problem(s)" in result.stdout


# ---- aggregate ----------------------------------------------------------------------------------------
@pytest.mark.processes
def test_aggregate_equals_aggregate_checkpoints_and_is_quiet_without_a_tty(zero_set, tmp_path):
    _, manifest = zero_set
    out = tmp_path / "agg.ortcp"
    result = run("aggregate", manifest, "-o", out)
    assert result.returncode == 0 and result.stderr == ""  # no progress bar when stderr is not a terminal
    assert result.stdout.startswith(f"wrote {out}: ")
    assert_same(C.aggregate_checkpoints(manifest), C.load(out))


@pytest.mark.processes
def test_aggregate_to_file_reports_progress(zero_set, tmp_path):
    calls = []
    C.aggregate_to_file(zero_set[1], tmp_path / "agg.ortcp", progress=lambda done, total: calls.append((done, total)))
    with C.open_checkpoint(tmp_path / "agg.ortcp") as reader:
        total = len(list(reader.walk()))
    assert calls == [(i, total) for i in range(1, total + 1)]  # once per value written, after it was written


# ---- convert ------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_convert_to_pt_loads_with_weights_only(full, tmp_path):
    path, state = full
    result = run("convert", path, "-o", tmp_path / "model.pt")
    assert result.returncode == 0, result.stderr
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_same(state["model"]["full_precision"], loaded)


@pytest.mark.processes
def test_convert_manifest_to_safetensors_with_optimizer(zero_set, full, tmp_path):
    from safetensors.torch import load_file

    state = full[1]
    result = run("convert", zero_set[1], "-o", tmp_path / "model.safetensors", "--optimizer")
    assert result.returncode == 0, result.stderr
    loaded = load_file(tmp_path / "model.safetensors")
    expected = dict(state["model"]["full_precision"])
    for name, entry in state["optimizer"].items():
        expected |= {f"optimizer/{name}/{key}": value for key, value in entry.items()}
    assert_same(expected, loaded)


@pytest.mark.processes
def test_reverse_convert_of_a_ddp_state_dict_loads_into_the_trainer(tmp_path):
    from ort_trainer import ORTTrainer, optim
    from tests.models import MLP, MLP_DESC

    torch.manual_seed(3)
    model = MLP()
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "ddp.pt")
    result = run("convert", tmp_path / "ddp.pt", "-o", tmp_path / "ckpt.ortcp", "--prefix-strip", "module.")
    assert result.returncode == 0, result.stderr
    tree = C.load(tmp_path / "ckpt.ortcp")
    assert sorted(tree) == ["model", "train_step_info", "trainer_options"]
    assert tree["train_step_info"] == {"optimization_step": 0, "step": 0} and tree["trainer_options"]["world_size"] == 1
    trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    assert trainer.load_checkpoint(tmp_path / "ckpt.ortcp") == {}
    trainer.eval_step(torch.randn(2, 20), torch.tensor([0, 1]))  # builds the engine, which applies the state
    assert_same(dict(model.state_dict()), trainer.state_dict(pytorch_format=True))


def test_reverse_convert_refuses_non_tensors_and_never_unpickles(tmp_path, capsys):
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"w": torch.ones(2), "epoch": 3, "opt": {"lr": torch.ones(1)}}, tmp_path / "mixed.pt")
    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    assert cli.main(["convert", str(tmp_path / "mixed.pt"), "-o", str(tmp_path / "a.ortcp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "got non-tensor values at ['epoch (int)', 'opt (dict)']" in err
    assert cli.main(["convert", str(tmp_path / "evil.pt"), "-o", str(tmp_path / "b.ortcp")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read with torch.load(weights_only=True)" in err and "Unsupported global" in err
    assert not marker.exists() and not (tmp_path / "a.ortcp").exists() and not (tmp_path / "b.ortcp").exists()


# ---- diff ---------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_diff_of_equal_checkpoints_exits_0(full, zero_set, tmp_path):
    C.aggregate_to_file(zero_set[1], tmp_path / "agg.ortcp")
    result = run("diff", full[0], tmp_path / "agg.ortcp")
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip().endswith("are equal (36 keys, exactly)")


@pytest.mark.processes
def test_diff_reports_keys_layouts_tensors_and_values(full, tmp_path):
    path, state = full
    state["model"]["full_precision"]["w1"][0, 0] += 1e-3
    state["model"]["full_precision"]["w2"][1, :3] += 0.5
    state["optimizer"]["b1"]["Moment_1"] = torch.zeros(13)
    state["train_step_info"]["step"] = 17
    del state["loss_scaler"]
    C.save(state, tmp_path / "changed.ortcp")
    result = run("diff", path, tmp_path / "changed.ortcp", "--atol", "1e-2")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"only in {path}: loss_scaler/loss_scale",
        f"only in {path}: loss_scaler/stable_steps",
        "type/shape/dtype differs: optimizer/b1/Moment_1: tensor (12,) float32 vs tensor (13,) float32",
        "tensor differs: model/full_precision/w2: max abs diff 0.5 (3 of 96 elements differ)",
        "value differs: train_step_info/step: 16 vs 17",
        f"5 difference(s) between {path} and {tmp_path / 'changed.ortcp'} (34 keys compared within atol=0.01, rtol=0)",
    ]  # w1 differs by 1e-3 < atol: not reported


def test_compare_tensors_tolerance_nan_and_sorting():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert compare_tensors("t", a, a.clone(), 0, 0) is None  # NaN at the same position is equal
    assert compare_tensors("t", a, a + 1e-4, 1e-3, 0) is None
    found = compare_tensors("t", a, torch.tensor([1.0, 2.0, 3.5]), 0, 0)
    assert found.detail == "max abs diff 0.5 (2 of 3 elements differ, 1 NaN on one side only)"
    diffs = [Difference("tensor", "small", "s", 0.1), Difference("only_b", "x"), Difference("tensor", "big", "b", 2.0)]
    assert [line.split(":")[1].strip() for line in format_diff(diffs, "A", "B", 3, 0, 0)[:3]] == ["x", "big", "small"]


# ---- errors -------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_errors_print_one_line_without_traceback_and_exit_2(tmp_path, zero_set):
    result = run("diff", tmp_path / "missing.ortcp", zero_set[0][0], module=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"ort-trainer-ckpt: error: {tmp_path / 'missing.ortcp'}: no such file\n"
    assert "Traceback" not in result.stderr


@pytest.mark.processes
def test_multi_line_errors_become_one_line(zero_set, tmp_path, capsys):
    paths, _ = zero_set
    assert cli.main(["aggregate", str(paths[0]), str(paths[2]), "-o", str(tmp_path / "out.ortcp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "ort-trainer-ckpt: error: the rank checkpoints do not form one complete save: missing rank(s) [1]"
    )
    (tmp_path / "out.ortcp").write_bytes(b"x")
    assert cli.main(["aggregate", str(zero_set[1]), "-o", str(tmp_path / "out.ortcp")]) == 2
    assert "out.ortcp already exists; pass --overwrite to replace it" in capsys.readouterr().err


def test_verify_and_inspect_exit_2_for_a_missing_or_non_checkpoint_input(full, tmp_path, capsys):
    """Both commands: an input that is no checkpoint or manifest at all is an error (2), not damage found (1)."""
    notes, weights = tmp_path / "notes.txt", tmp_path / "w.pt"
    notes.write_text("not a checkpoint\n")
    torch.save({"w": torch.ones(2)}, weights)
    for path in (tmp_path / "missing.ortcp", notes, weights):
        assert cli.main(["inspect", str(path)]) == 2
        inspected = capsys.readouterr().err
        assert cli.main(["verify", str(path)]) == 2
        verified = capsys.readouterr().err
        assert inspected.startswith(f"ort-trainer-ckpt: error: {path}") and verified.startswith(inspected[:40])
    assert cli.main(["verify", str(notes), str(full[0])]) == 2  # the others are still verified
    out = capsys.readouterr().out
    assert f"ok    {full[0]}: " in out and "1 input(s) not verified" in out


def test_inspect_names_only_what_it_reads(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    assert cli.main(["inspect", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err == f"ort-trainer-ckpt: error: {notes} is not a checkpoint (HDF5) or a manifest (.manifest.json)\n"
