"""Megatron partitions (column / row), the D x H grid with ZeRO, and their aggregation."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.sets import megatron
from tests.rank_states import assert_same, full_state, save_ranks

# GPT-2 style MLP: fc1 weight + bias by column, fc2 weight by row, fc2 bias and LayerNorm replicated.
SHAPES = {"fc1.w": (8, 16), "fc1.b": (16,), "fc2.w": (16, 8), "fc2.b": (8,), "ln.w": (8,)}
COLUMN, ROW = ["fc1.w", "fc1.b"], ["fc2.w"]


def mlp_state(optimizer: str = "AdamOptimizer", seed: int = 0) -> dict:
    return full_state(optimizer, seed=seed, shapes=SHAPES)


@pytest.mark.parametrize("H", [2, 4])
@pytest.mark.parametrize("optimizer", ["AdamOptimizer", "LambOptimizer", "SGDOptimizer"])
def test_partition_then_aggregate_is_bit_exact(optimizer, H):
    full = mlp_state(optimizer)
    states = megatron.partition(full, H, column=COLUMN, row=ROW, run_id="r")
    assert_same(full, C.aggregate_states(states[::-1]))


def test_rank_states_hold_the_legacy_megatron_layout():
    full = mlp_state()
    states = megatron.partition(full, 2, column=COLUMN, row=ROW, run_id="r")
    s1 = states[1]
    assert s1["trainer_options"] | {"optimizer_name": None} == {
        "mixed_precision": False,
        "zero_stage": 0,
        "world_rank": 1,
        "world_size": 2,
        "optimizer_name": None,
        "data_parallel_size": 1,
        "horizontal_parallel_size": 2,
    }
    weights = s1["model"]["full_precision"]
    assert torch.equal(weights["fc1.w"], full["model"]["full_precision"]["fc1.w"][:, 8:])  # column: last axis
    assert torch.equal(weights["fc2.w"], full["model"]["full_precision"]["fc2.w"][8:])  # row: axis 0
    assert torch.equal(weights["fc2.b"], full["model"]["full_precision"]["fc2.b"])  # replicated
    assert torch.equal(s1["optimizer"]["fc1.b"]["Moment_2"], full["optimizer"]["fc1.b"]["Moment_2"][8:])
    assert s1["optimizer"]["fc1.w"]["Update_Count"].tolist() == [9]
    assert s1["partition_info"] == {
        "fc1.w": {"original_dim": [8, 16], "megatron_row_partition": [0]},
        "fc1.b": {"original_dim": [16], "megatron_row_partition": [0]},
        "fc2.w": {"original_dim": [16, 8], "megatron_row_partition": [1]},
    }
    assert s1["distributed"] == {"run_id": "r"}


@pytest.mark.parametrize(("D", "H"), [(2, 2), (3, 2), (2, 4)])
def test_zero_and_megatron_grid_through_files(tmp_path, D, H):
    full = mlp_state("LambOptimizer", seed=D * H)
    grid = megatron.partition_grid(full, D, H, column=COLUMN, row=ROW, zero_stage=1)
    assert [s["trainer_options"]["world_rank"] for s in grid] == list(range(D * H))
    assert {(s["trainer_options"]["data_parallel_size"], s["trainer_options"]["world_size"]) for s in grid} == {
        (D, D * H)
    }
    paths = save_ranks(grid, tmp_path)
    random.Random(0).shuffle(paths)
    assert_same(full, C.aggregate_checkpoints(paths))
    assert_same(full, C.load(C.aggregate_to_file(paths, tmp_path / "full.ortcp")))


def test_grid_rank_is_d_times_h_plus_h():
    full = mlp_state()
    grid = megatron.partition_grid(full, 2, 2, column=COLUMN, row=ROW, zero_stage=1)
    fc1_b = full["model"]["full_precision"]["fc1.b"]
    for rank, state in enumerate(grid):
        h = rank % 2  # ranks 0, 2 hold Megatron slice 0; ranks 1, 3 slice 1
        assert torch.equal(state["model"]["full_precision"]["fc1.b"], fc1_b[8 * h : 8 * h + 8])
    # Per h column, ZeRO over D = 2: 152 elements padded to 192, C = 96. fc2.w's 64-element row slice
    # spans [72, 136): 24 elements on d = 0, 40 on d = 1, offsets within the flattened slice.
    assert [s["partition_info"]["fc2.w"] for s in grid] == [
        {"original_dim": [16, 8], "megatron_row_partition": [1], "offset": offset} for offset in (0, 0, 24, 24)
    ]
    assert [tuple(s["optimizer"]["fc2.w"]["Moment_1"].shape) for s in grid] == [(24,), (24,), (40,), (40,)]
    slice_1 = full["optimizer"]["fc2.w"]["Moment_1"][8:].reshape(-1)
    assert torch.equal(grid[3]["optimizer"]["fc2.w"]["Moment_1"], slice_1[24:])
    assert ["fc1.w" in s["optimizer"] for s in grid] == [True, True, False, False]
    assert grid[3]["partition_info"]["fc1.w"] == {"original_dim": [8, 16], "megatron_row_partition": [0]}


def test_megatron_with_plain_data_parallel_replicas():
    full = mlp_state()
    grid = megatron.partition_grid(full, 2, 2, column=COLUMN, row=ROW, zero_stage=0)
    assert_same(grid[0]["optimizer"], grid[2]["optimizer"])
    assert_same(full, C.aggregate_states(grid))


def test_strided_stride_one_is_a_plain_column_partition():
    full = mlp_state()
    states = megatron.partition(full, 2, column=["fc1.w"], row=ROW, strided={"fc1.b": 1})
    assert states[0]["partition_info"]["fc1.b"]["megatron_row_partition"] == [0]
    assert_same(full, C.aggregate_states(states))


# ---- errors ---------------------------------------------------------------------------------------
def test_uneven_split_names_tensor_axis_size_and_h():
    full = mlp_state()
    with pytest.raises(ValueError) as info:
        megatron.partition(full, 3, column=COLUMN, row=ROW)
    message = str(info.value)
    assert "'fc1.w' shape (8, 16): axis 1 (size 16) is not divisible by horizontal_parallel_size=3" in message
    assert "'fc1.b' shape (16,): axis 0 (size 16) is not divisible by horizontal_parallel_size=3" in message
    assert "'fc2.w' shape (16, 8): axis 0 (size 16)" in message


def test_names_in_both_lists_unknown_or_repeated_are_refused():
    full = mlp_state()
    with pytest.raises(ValueError, match=r"listed as both column and row partitioned: \['fc2.w'\]"):
        megatron.partition(full, 2, column=["fc2.w"], row=["fc2.w"])
    with pytest.raises(ValueError, match=r"not model weights: \['fc3.w', 'nope'\]"):
        megatron.partition(full, 2, column=["nope", "fc1.w"], row=["fc3.w"])
    with pytest.raises(ValueError, match=r"listed more than once: \['fc1.b'\]"):
        megatron.partition(full, 2, column=["fc1.b", "fc1.b"])
    with pytest.raises(TypeError, match="column must be a sequence of weight names"):
        megatron.partition(full, 2, column="fc1.w")
    with pytest.raises(ValueError, match="'scale' is 0-d and has no axis to partition"):
        megatron.partition(full_state(), 2, column=["scale"])


def test_strided_partitions_are_refused_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"strided column partitions are not supported: \{'qkv': 3\}.*"):
        megatron.partition(mlp_state(), 2, strided={"qkv": 3})
    with pytest.raises(NotImplementedError, match="concatenating the rank slices along the last axis"):
        megatron.partition(mlp_state(), 2, strided={"fc1.w": 2})
    with pytest.raises(ValueError, match=r"strides must be ints >= 1, got \['fc1.w: 0'\]"):
        megatron.partition(mlp_state(), 2, strided={"fc1.w": 0})


def test_partition_needs_a_full_state():
    states = megatron.partition(mlp_state(), 2, column=COLUMN)
    with pytest.raises(ValueError, match="needs a full single-process state, got world_size=2"):
        megatron.partition(states[0], 2, column=COLUMN)


def test_inconsistent_megatron_partition_info_is_named():
    states = copy.deepcopy(megatron.partition(mlp_state(), 2, column=COLUMN, row=ROW))
    states[1]["partition_info"]["fc1.w"]["original_dim"] = [8, 32]
    del states[0]["partition_info"]["fc2.w"]
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    message = str(info.value)
    assert (
        "'partition_info/fc1.w': (original_dim, megatron_row_partition) differs between ranks: "
        "((8, 16), 0) on rank 0 (states[0]); ((8, 32), 0) on rank 1 (states[1])"
    ) in message
    assert "'partition_info/fc2.w' (Megatron partitioned) is missing on rank 0 (states[0])" in message


def test_replicated_tensor_that_differs_across_h_is_named():
    states = copy.deepcopy(megatron.partition(mlp_state(), 2, column=COLUMN, row=ROW))
    states[1]["model"]["full_precision"]["ln.w"] = states[1]["model"]["full_precision"]["ln.w"] + 1
    with pytest.raises(C.AggregationError, match=r"'model/full_precision/ln.w' on rank 1 \(states\[1\]\) differs"):
        C.aggregate_states(states)


def test_wrong_slice_shape_is_named():
    states = copy.deepcopy(megatron.partition(mlp_state(), 2, column=COLUMN, row=ROW))
    states[1]["model"]["full_precision"]["fc1.w"] = torch.zeros(8, 4)
    with pytest.raises(
        C.AggregationError, match=r"'model/full_precision/fc1.w': expected shape \(8, 8\) .*got \(8, 4\)"
    ):
        C.aggregate_states(states)


# ---- crafted partition_info: the stride and original_dim of a Megatron entry (issue 32, item 7) ----------
def _crafted_files(tmp_path, name: str, **entry) -> list:
    """A 2-rank Megatron set whose ``partition_info/<name>`` entry is changed on every rank."""
    states = copy.deepcopy(megatron.partition(mlp_state(), 2, column=COLUMN, row=ROW))
    for state in states:
        state["partition_info"][name].update(entry)
    return save_ranks(states, tmp_path)


def _aggregation_message(paths) -> str:
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_checkpoints(paths)
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "stride", "expected"),
    [
        ("fc1.b", 3, "stride 3 does not divide axis 0 of original_dim [16] (size 16)"),
        ("fc1.w", 5, "stride 5 does not divide axis 1 of original_dim [8, 16] (size 16)"),
        ("fc1.b", 16, "axis 0 of original_dim [16] (size 16) is not a multiple of horizontal_parallel_size x stride"),
    ],
)
def test_a_stride_that_does_not_fit_the_axis_names_the_stride_and_the_rank_files(tmp_path, name, stride, expected):
    message = _aggregation_message(_crafted_files(tmp_path, name, stride=stride))
    assert f"'partition_info/{name}'" in message and expected in message, message
    assert "rank 0 (ckpt.rank0-of-2.ortcp)" in message and "rank 1 (ckpt.rank1-of-2.ortcp)" in message, message
    assert "cannot be split into horizontal_parallel_size" not in message, message
    assert message.count(expected) == 1, message  # once per name, not once per weight and moment


def test_a_0d_original_dim_names_the_entry_and_the_rank_files(tmp_path):
    message = _aggregation_message(_crafted_files(tmp_path, "fc1.b", original_dim=[]))
    assert "'partition_info/fc1.b'" in message and "original_dim [] is 0-d" in message, message
    assert "rank 0 (ckpt.rank0-of-2.ortcp)" in message and "rank 1 (ckpt.rank1-of-2.ortcp)" in message, message
    assert "horizontal_parallel_size" not in message, message


def test_a_scalar_original_dim_is_named_not_a_python_error(tmp_path):
    message = _aggregation_message(_crafted_files(tmp_path, "fc1.b", original_dim=16))
    assert "ckpt.rank0-of-2.ortcp: partition_info/fc1.b" in message, message
    assert "original_dim: expected a list of sizes (the full shape), got the 0-d value 16" in message, message
    assert "not iterable" not in message, message


def test_an_axis_that_horizontal_parallel_size_does_not_divide_names_the_rank_files(tmp_path):
    message = _aggregation_message(_crafted_files(tmp_path, "fc1.b", original_dim=[15]))
    assert "'partition_info/fc1.b'" in message, message
    assert "axis 0 of original_dim [15] (size 15) is not divisible by horizontal_parallel_size=2" in message, message
    assert "rank 0 (ckpt.rank0-of-2.ortcp)" in message and "rank 1 (ckpt.rank1-of-2.ortcp)" in message, message
