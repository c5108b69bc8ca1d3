"""Aggregation of ZeRO rank states: reshard/aggregate round trips, set validation, file layer, streaming."""

from __future__ import annotations

import copy
import itertools
import math
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.sets._zero import zero_pieces
from tests.builders import legacy_trainer_options
from tests.rank_states import FLAT, SHAPES, assert_same, full_state, save_ranks

REPO = Path(__file__).resolve().parents[2]
OPTIMIZERS = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")
# 224 + 12 + 96 + 8 + 1 = 341 trainable elements: w1 straddles a rank boundary for every D > 1 and
# spans three ranks for D = 4 (C = 96); w2 straddles for D = 3 and 4.


# ---- layout ---------------------------------------------------------------------------------------
def test_zero_layout_pads_to_d_times_32_and_splits_straddling_parameters():
    numels = [(n, math.prod(s)) for n, s in SHAPES.items()]
    # D = 4: 341 elements padded to 384 (a multiple of 4 * 32), C = 96
    pieces = zero_pieces(numels, 4)
    assert [(p.rank, p.offset, p.numel, p.whole) for p in pieces["w1"]] == [
        (0, 0, 96, False),
        (1, 96, 96, False),
        (2, 192, 32, False),
    ]
    assert [(p.rank, p.offset, p.numel) for p in pieces["w2"]] == [(2, 0, 52), (3, 52, 44)]
    assert [(p.rank, p.whole) for p in pieces["b2"]] == [(3, True)]
    # D = 2: padded 384 (a multiple of 64), C = 192
    pieces = zero_pieces(numels, 2)
    assert [(p.rank, p.offset, p.numel) for p in pieces["w1"]] == [(0, 0, 192), (1, 192, 32)]
    assert [(p.rank, p.whole) for p in pieces["w2"]] == [(1, True)]
    # an empty parameter belongs to the rank holding its start; an empty buffer to rank 0
    assert zero_pieces([("a", 100), ("e", 0)], 2)["e"][0].rank == 1
    assert zero_pieces([("e", 0)], 3)["e"][0].rank == 0


def test_rank_states_follow_the_per_rank_format():
    states = C.reshard_state(full_state("AdamOptimizer"), 4, zero_stage=1, flat_order=FLAT, run_id="run-1")
    assert [s["trainer_options"]["world_rank"] for s in states] == [0, 1, 2, 3]
    for s in states:
        expected = legacy_trainer_options(zero_stage=1, world_size=4, data_parallel_size=4)
        assert s["trainer_options"] | {"world_rank": 0} == expected
        assert s["distributed"] == {"run_id": "run-1", "flat_order": FLAT}
        assert s["model"]["full_precision"].keys() == full_state()["model"]["full_precision"].keys()
    # w1 (224 elements, C = 96) spans ranks 0-2: 1-D pieces + partition_info with offsets
    assert [s["optimizer"]["w1"]["Moment_1"].shape for s in states[:3]] == [(96,), (96,), (32,)]
    assert states[2]["partition_info"]["w1"] == {
        "original_dim": [16, 14],
        "megatron_row_partition": [-1],
        "offset": 192,
    }
    assert [s["optimizer"]["w1"]["Update_Count"].tolist() for s in states[:3]] == [[9]] * 3
    assert torch.equal(
        states[1]["optimizer"]["w1"]["Moment_2"], full_state()["optimizer"]["w1"]["Moment_2"].view(-1)[96:192]
    )
    # b2 is whole on rank 3 only, without a partition_info entry
    assert [("b2" in s["optimizer"]) for s in states] == [False, False, False, True]
    assert states[3]["optimizer"]["b2"]["Moment_1"].shape == (8,)
    assert "b2" not in states[3]["partition_info"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_lamb_step_is_on_every_rank(optimizer):
    states = C.reshard_state(full_state(optimizer), 3, zero_stage=1)
    shared = ["shared_optimizer_state" in s["optimizer"] for s in states]
    assert shared == [optimizer == "LambOptimizer"] * 3


# ---- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_reshard_then_aggregate_is_bit_exact(optimizer, world_size):
    full = full_state(optimizer)
    states = C.reshard_state(full, world_size, zero_stage=1, flat_order=FLAT)
    assert_same(full, C.aggregate_states(states))
    assert_same(full["model"]["full_precision"], C.aggregate_states(states, pytorch_format=True))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_files_round_trip_bit_exact_in_any_order(tmp_path, optimizer, world_size):
    full = full_state(optimizer, seed=world_size)
    paths = save_ranks(C.reshard_state(full, world_size, zero_stage=2, flat_order=FLAT[::-1]), tmp_path)
    random.Random(world_size).shuffle(paths)
    assert_same(full, C.aggregate_checkpoints(paths))
    out = C.aggregate_to_file(paths, tmp_path / "full.ortcp")
    assert_same(full, C.load(out))
    C.aggregate_to_file(paths[::-1], tmp_path / "weights.ortcp", pytorch_format=True)
    assert_same(full["model"]["full_precision"], C.load(tmp_path / "weights.ortcp"))


def test_result_does_not_depend_on_state_order():
    full = full_state("LambOptimizer")
    states = C.reshard_state(full, 3, zero_stage=1, flat_order=FLAT)
    for perm in itertools.permutations(states):
        assert_same(full, C.aggregate_states(list(perm)))
    broken = copy.deepcopy(states)
    broken[2]["lr_scheduler"]["last_step"] = 7
    messages = set()
    for perm in itertools.permutations(broken):
        with pytest.raises(C.AggregationError) as info:
            C.aggregate_states(list(perm))
        messages.add(re.sub(r" \(states\[\d\]\)", "", str(info.value)))  # labels follow the input order
    assert messages == {
        "rank checkpoints disagree on values that must be identical:\n"
        "  - 'lr_scheduler/last_step' on rank 2 differs from rank 0"
    }


def test_plain_data_parallel_replicas_aggregate():
    full = full_state("AdamOptimizer")
    states = C.reshard_state(full, 2, zero_stage=0)
    assert "partition_info" not in states[0]
    assert_same(full, C.aggregate_states(states))


def test_result_is_a_single_process_state_that_keeps_step_info_and_rank0_user_dict():
    full = full_state("AdamOptimizer")
    states = C.reshard_state(full, 2, zero_stage=1)
    states[1] = {**states[1], "user_dict": {"epoch": 99}}  # user_dict is taken from rank 0
    out = C.aggregate_states(states)
    assert out["trainer_options"] == full["trainer_options"]
    assert out["train_step_info"] == {"optimization_step": 8, "step": 16}
    assert out["user_dict"] == {"epoch": 2, "note": "hello"}
    assert "partition_info" not in out and "distributed" not in out
    out["model"]["full_precision"]["w1"].add_(1)  # fresh tensors: the inputs are untouched
    assert_same(full_state("AdamOptimizer")["model"], full["model"])


def test_legacy_pieces_without_offset_are_placed_in_rank_order():
    full = full_state("AdamOptimizer")
    states = C.reshard_state(full, 4, zero_stage=1)
    for s in states:
        for entry in s["partition_info"].values():
            del entry["offset"]
        del s["distributed"]
    assert_same(full, C.aggregate_states(states))


# ---- set validation -------------------------------------------------------------------------------
def _states(world_size=3, optimizer="AdamOptimizer", **kw):
    return copy.deepcopy(C.reshard_state(full_state(optimizer), world_size, zero_stage=1, flat_order=FLAT, **kw))


def test_missing_trainer_options_is_named():
    states = _states()
    del states[1]["trainer_options"]
    with pytest.raises(C.AggregationError, match=r"states\[1\]: has no 'trainer_options' group"):
        C.aggregate_states(states)


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("world_size", 4, r"world_size differs: 3 on rank 0 \(states\[0\]\), rank 1 \(states\[1\]\); 4 on rank 2"),
        ("zero_stage", 2, r"zero_stage differs: 1 on .*; 2 on rank 2 \(states\[2\]\)"),
        ("optimizer_name", "LambOptimizer", r"optimizer_name differs: 'AdamOptimizer' on .*'LambOptimizer' on rank 2"),
        ("mixed_precision", True, r"mixed_precision differs: False on .*; True on rank 2"),
    ],
)
def test_trainer_option_disagreement_names_key_and_ranks(key, value, pattern):
    states = _states()
    states[2]["trainer_options"][key] = value
    with pytest.raises(C.AggregationError, match=pattern):
        C.aggregate_states(states)


def test_run_id_and_step_disagreements_are_all_reported():
    states = _states(run_id="a")
    states[0]["distributed"]["run_id"] = "b"
    states[1]["train_step_info"] = {"optimization_step": 9, "step": 18}
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    message = str(info.value)
    assert "distributed/run_id differs: 'a' on rank 1 (states[1]), rank 2 (states[2]); 'b' on rank 0" in message
    assert "train_step_info differs: {'optimization_step': 8, 'step': 16} on rank 0 (states[0]), rank 2" in message


def test_missing_and_duplicate_ranks_are_named():
    states = _states(world_size=4)
    with pytest.raises(C.AggregationError, match=r"missing rank\(s\) \[1, 3\] of world_size 4"):
        C.aggregate_states([states[0], states[2]])
    with pytest.raises(C.AggregationError, match=r"rank 2 appears 2 times: states\[2\], states\[3\]"):
        C.aggregate_states([states[0], states[1], states[2], states[2], states[3]])
    with pytest.raises(C.AggregationError, match="no rank checkpoints given"):
        C.aggregate_states([])


def test_topology_must_multiply_to_world_size():
    states = _states(world_size=2)
    for s in states:
        s["trainer_options"]["horizontal_parallel_size"] = 2
    with pytest.raises(C.AggregationError, match=r"data_parallel_size 2 x horizontal_parallel_size 2 != world_size 2"):
        C.aggregate_states(states)


# ---- content validation ---------------------------------------------------------------------------
def test_gap_between_pieces_names_tensor_and_ranks():
    states = _states(world_size=4)
    states[1]["optimizer"]["w1"]["Moment_1"] = states[1]["optimizer"]["w1"]["Moment_1"][:40]
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    message = str(info.value)
    assert "'optimizer/w1/Moment_1': ZeRO pieces do not tile its 224 elements: gap [136, 192)" in message
    assert "pieces: rank 0 (states[0]) [0, 96), rank 1 (states[1]) [96, 136), rank 2 (states[2]) [192, 224)" in message


def test_overlapping_pieces_are_reported():
    states = _states(world_size=4)
    states[1]["partition_info"]["w1"]["offset"] = 90
    with pytest.raises(C.AggregationError, match=r"'optimizer/w1/Moment_2': .*ranks 0 and 1 overlap on \[90, 96\)"):
        C.aggregate_states(states)


def test_whole_copies_that_differ_are_named():
    states = copy.deepcopy(C.reshard_state(full_state(), 3, zero_stage=0))
    states[2]["optimizer"]["w2"]["Moment_1"] = states[2]["optimizer"]["w2"]["Moment_1"].clone()
    states[2]["optimizer"]["w2"]["Moment_1"][0, 0] += 1
    states[1]["model"]["full_precision"]["b1"] = torch.zeros(12)
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    message = str(info.value)
    assert "'model/full_precision/b1' on rank 1 (states[1]) differs from rank 0 (states[0])" in message
    assert "'optimizer/w2/Moment_1' on rank 2 (states[2]) differs from rank 0 (states[0])" in message


def test_replicated_values_and_counters_must_be_identical():
    states = _states(world_size=4, optimizer="LambOptimizer")
    states[3]["lr_scheduler"]["base_lr"] = 0.5
    states[2]["optimizer"]["shared_optimizer_state"]["Step"] = torch.tensor([10])
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    assert "'lr_scheduler/base_lr' on rank 3 (states[3]) differs from rank 0 (states[0])" in str(info.value)
    assert "'optimizer/shared_optimizer_state/Step' on rank 2 (states[2]) differs" in str(info.value)


def test_straddling_update_counts_must_agree():
    states = _states(world_size=4)
    states[1]["optimizer"]["w1"]["Update_Count"] = torch.tensor([3])
    with pytest.raises(C.AggregationError, match=r"'optimizer/w1/Update_Count' on rank 1 \(states\[1\]\) differs"):
        C.aggregate_states(states)


def test_missing_entries_are_reported_before_reading():
    states = _states(world_size=4)
    del states[3]["optimizer"]["b2"]  # its only owner lost it
    del states[0]["optimizer"]["w1"]["Moment_2"]  # a piece is missing
    del states[3]["loss_scaler"]
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    message = str(info.value)
    assert "no rank holds optimizer state for ['b2'] (listed in distributed/flat_order)" in message
    assert "'optimizer/w1/Moment_2' is missing on rank 0 (states[0])" in message
    assert "'loss_scaler' is missing on rank 3 (states[3])" in message


def test_whole_entry_next_to_pieces_is_refused():
    states = _states(world_size=4)
    states[2]["optimizer"]["w1"] = copy.deepcopy(full_state()["optimizer"]["w1"])
    with pytest.raises(C.AggregationError, match=r"'optimizer/w1/Moment_1' is whole on rank 2 .* but ZeRO pieces on"):
        C.aggregate_states(states)


def test_wrong_shape_is_named():
    states = _states(world_size=2)
    states[1]["model"]["full_precision"]["w2"] = torch.zeros(8, 12)
    with pytest.raises(C.AggregationError, match=r"'model/full_precision/w2': shape differs between ranks: \(12, 8\)"):
        C.aggregate_states(states)


# ---- reshard_state validation ---------------------------------------------------------------------
def test_reshard_validates_its_input():
    full = full_state()
    with pytest.raises(ValueError, match=r"names listed more than once: \['b1'\].*not model weights: \['nope'\]"):
        C.reshard_state(full, 2, zero_stage=1, flat_order=[*FLAT, "b1", "nope"])
    with pytest.raises(ValueError, match=r"optimizer entries missing from the order: \['scale', 'w2'\]"):
        C.reshard_state(full, 2, zero_stage=1, flat_order=["w1", "b1", "b2"])
    with pytest.raises(ValueError, match=r"needs a full single-process state, got world_size=2"):
        C.reshard_state(C.reshard_state(full, 2, zero_stage=1)[0], 2, zero_stage=1)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        C.reshard_state(full, 0, zero_stage=1)


# ---- file layer -----------------------------------------------------------------------------------
@pytest.fixture
def rank_files(tmp_path):
    full = full_state("AdamOptimizer")
    return full, save_ranks(C.reshard_state(full, 3, zero_stage=1, flat_order=FLAT, run_id="run-a"), tmp_path)


def test_incomplete_set_names_files_and_ranks(rank_files):
    _, paths = rank_files
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_checkpoints([paths[2], paths[0]])
    assert (
        "missing rank(s) [1] of world_size 3 (got rank 0 (ckpt.rank0-of-3.ortcp), rank 2 (ckpt.rank2-of-3.ortcp))"
        in str(info.value)
    )
    with pytest.raises(C.AggregationError, match=r"rank 0 appears 2 times: \S*/ckpt.rank0-of-3.ortcp, \S*/ckpt.rank0"):
        C.aggregate_checkpoints([*paths, paths[0]])
    with pytest.raises(C.CheckpointNotFoundError, match=r"1 rank checkpoint file\(s\) do not exist: .*nope.ortcp"):
        C.aggregate_checkpoints([*paths, paths[0].with_name("nope.ortcp")])


def test_files_of_another_run_or_step_are_refused(rank_files, tmp_path):
    _, paths = rank_files
    later = full_state("AdamOptimizer") | {"train_step_info": {"optimization_step": 9, "step": 18}}
    (tmp_path / "b").mkdir()
    other = save_ranks(C.reshard_state(later, 3, zero_stage=1, run_id="run-b"), tmp_path / "b", "x.ortcp")
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_checkpoints([paths[0], paths[1], other[2]])
    message = str(info.value)
    assert "distributed/run_id differs: 'run-a' on rank 0 (ckpt.rank0-of-3.ortcp), rank 1" in message
    assert "'run-b' on rank 2 (x.rank2-of-3.ortcp)" in message
    assert "train_step_info differs" in message


def test_set_is_validated_before_any_tensor_is_read(rank_files):
    _, paths = rank_files
    _damage_payload(paths[1])
    with pytest.raises(C.AggregationError, match=r"missing rank\(s\) \[2\]"):
        C.aggregate_checkpoints(paths[:2])
    with pytest.raises(C.CheckpointCorruptError, match="checksum mismatch"):
        C.aggregate_checkpoints(paths)


def _damage_payload(path: Path) -> None:
    """Flip one byte inside the largest dataset's raw data (not the HDF5 metadata)."""
    with C.open_checkpoint(path) as reader:
        key = max(reader.walk(), key=lambda kv: math.prod(kv[1].shape))[0]
        node = reader._node(key)
        offset = node.dataset.get_offset()
    data = bytearray(path.read_bytes())
    data[offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_streaming_failure_leaves_no_file(rank_files, tmp_path):
    _, paths = rank_files
    states = [C.load(p) for p in paths]
    states[1]["loss_scaler"]["loss_scale"] = 2.0
    (tmp_path / "bad").mkdir()
    bad = save_ranks(states, tmp_path / "bad", "y.ortcp")
    with pytest.raises(C.AggregationError, match=r"'loss_scaler/loss_scale' on rank 1 \(y.rank1-of-3.ortcp\) differs"):
        C.aggregate_to_file(bad, tmp_path / "out.ortcp")
    assert not list(tmp_path.glob("*out.ortcp*"))
    C.aggregate_to_file(paths, tmp_path / "out.ortcp")
    with pytest.raises(C.CheckpointExistsError):
        C.aggregate_to_file(paths, tmp_path / "out.ortcp")


# ---- streaming memory -----------------------------------------------------------------------------
# VmHWM is the peak RSS of this process image (ru_maxrss would include the parent's peak: Linux
# carries it over fork + exec). Streaming runs first, then everything is loaded for comparison.
_MEASURE = textwrap.dedent(
    """
    import sys
    import torch  # before the baseline: ort_trainer.checkpoint imports it only on first use
    from ort_trainer import checkpoint as C
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    out, paths = sys.argv[1], sys.argv[2:]
    base = status("VmRSS")
    C.aggregate_to_file(paths, out)
    stream = status("VmHWM") - base
    states = [C.load(p) for p in paths]
    print(stream, status("VmHWM") - base)
    """
)


@pytest.mark.processes
def test_streaming_peak_memory_is_about_two_tensors(tmp_path):
    numel = 2 * 1024 * 1024  # 8 MB of float32 per tensor
    full = full_state("AdamOptimizer", shapes={f"layer{i}.weight": (numel,) for i in range(8)})
    paths = [str(p) for p in save_ranks(C.reshard_state(full, 2, zero_stage=1), tmp_path)]
    cmd = [sys.executable, "-c", _MEASURE, str(tmp_path / "full.ortcp"), *paths]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    stream, load_all = map(int, done.stdout.split())
    tensor = numel * 4
    assert stream < 4 * tensor, (stream, load_all)  # measured: ~23 MB (two 8 MB buffers)
    assert load_all > 30 * tensor, (stream, load_all)  # the two files hold 32 tensors
    assert_same(full, C.load(tmp_path / "full.ortcp"))
