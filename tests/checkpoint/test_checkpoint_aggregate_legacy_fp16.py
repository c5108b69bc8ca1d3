"""Aggregation of legacy ORTTrainer ZeRO + mixed-precision saves (reference §3.2).

With ZeRO and mixed precision the legacy backend partitions the fp32 master weights like the
moments: a weight inside one rank's range is saved whole by that (owner) rank only; a weight that
straddles a rank boundary is saved as 1-D pieces, one per rank it touches, each listed in that
rank's ``partition_info`` (legacy files have no ``offset``: pieces go in rank order). The rank sets
here are derived from a full state with the ZeRO layout of ``checkpoint._zero`` and must aggregate
back to it bit for bit, in memory and streaming, from our files and from raw legacy-style HDF5.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import h5py
import pytest
import torch

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.sets._zero import zero_pieces
from tests.rank_states import FLAT, SHAPES, assert_same, full_state, save_ranks

# D = 2 (C = 192): w1 is pieces on ranks 0 and 1; b1, w2, b2, scale are whole on rank 1 only.
# D = 3 (C = 128): w1 pieces on ranks 0-1, b1 whole on 1, w2 pieces on ranks 1-2, b2 and scale whole on 2.
OWNERS = {
    2: {"w1": [0, 1], "b1": [1], "w2": [1], "b2": [1], "scale": [1]},
    3: {"w1": [0, 1], "b1": [1], "w2": [1, 2], "b2": [2], "scale": [2]},
}


def fp16_full_state(optimizer: str = "AdamOptimizer", shapes: dict | None = None) -> dict:
    full = full_state(optimizer, seed=7, shapes=shapes)
    full["trainer_options"]["mixed_precision"] = True
    return full


def legacy_fp16_states(full: dict, world_size: int, *, flag=(-1,), offsets: bool = False) -> list[dict]:
    """The rank states a legacy ZeRO-1 + fp16 run saves: fp32 weights on owners / in pieces."""
    model = full["model"]["full_precision"]
    order = [n for n in FLAT if n in model]
    pieces = zero_pieces([(n, model[n].numel()) for n in order], world_size)
    states = copy.deepcopy(C.reshard_state(full, world_size, zero_stage=1, flat_order=order))
    for rank, state in enumerate(states):
        del state["distributed"]
        weights = state["model"]["full_precision"]
        for name in order:
            mine = [p for p in pieces[name] if p.rank == rank]
            if not mine:
                del weights[name]
            elif not mine[0].whole:
                p = mine[0]
                weights[name] = model[name].reshape(-1)[p.offset : p.offset + p.numel].clone()
        for name, entry in state["partition_info"].items():
            assert name in weights and weights[name].dim() == 1
            entry["megatron_row_partition"] = list(flag) if isinstance(flag, tuple) else flag
            if not offsets:
                del entry["offset"]
    return states


def write_legacy(state: Mapping, path: Path) -> Path:
    """Write like the legacy ``_checkpoint_storage.save``: plain h5py, no attributes, no checksums."""

    def put(group: h5py.Group, tree: Mapping) -> None:
        for key, value in tree.items():
            if isinstance(value, Mapping):
                put(group.create_group(key), value)
            else:
                group[key] = value.numpy() if isinstance(value, torch.Tensor) else value

    with h5py.File(path, "w-") as f:
        put(f, state)
    return path


@pytest.mark.parametrize("world_size", [2, 3])
def test_layout_of_the_hand_made_sets(world_size):
    states = legacy_fp16_states(fp16_full_state(), world_size)
    for name in FLAT:
        holders = [r for r, s in enumerate(states) if name in s["model"]["full_precision"]]
        assert holders == OWNERS[world_size][name], name
        assert [r for r, s in enumerate(states) if name in s["optimizer"]] == holders, name
        for r in holders:
            assert states[r]["optimizer"][name]["Update_Count"].tolist() == [9]
    for s in states:
        assert "distributed" not in s and "frozen.emb" in s["model"]["full_precision"]
        for entry in s["partition_info"].values():
            assert entry == {"original_dim": entry["original_dim"], "megatron_row_partition": [-1]}
    assert states[0]["model"]["full_precision"]["w1"].shape == (128 if world_size == 3 else 192,)


@pytest.mark.parametrize("flag", [(-1,), -1], ids=["flag-list", "flag-int"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer", ["AdamOptimizer", "LambOptimizer"])
def test_in_memory_and_streaming_are_bit_exact(tmp_path, optimizer, world_size, flag):
    full = fp16_full_state(optimizer)
    states = legacy_fp16_states(full, world_size, flag=flag)
    assert_same(full, C.aggregate_states(states))
    assert_same(full["model"]["full_precision"], C.aggregate_states(states[::-1], pytorch_format=True))
    paths = save_ranks(states, tmp_path)
    assert_same(full, C.aggregate_checkpoints(paths[::-1]))
    assert_same(full, C.load(C.aggregate_to_file(paths, tmp_path / "full.ortcp")))
    C.aggregate_to_file(paths, tmp_path / "weights.ortcp", pytorch_format=True)
    assert_same(full["model"]["full_precision"], C.load(tmp_path / "weights.ortcp"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_raw_legacy_hdf5_files_aggregate_bit_exact(tmp_path, world_size):
    # legacy files load 0-d numbers as python scalars, so no 0-d weight here
    full = fp16_full_state(shapes={n: s for n, s in SHAPES.items() if n != "scale"})
    states = legacy_fp16_states(full, world_size)
    paths = [write_legacy(s, tmp_path / f"ORT_checkpoint.rank{r}.ortcp") for r, s in enumerate(states)]
    with C.open_checkpoint(paths[0]) as reader:
        assert reader.is_legacy
    assert_same(full, C.aggregate_checkpoints(paths[::-1]))
    assert_same(full, C.load(C.aggregate_to_file(paths, tmp_path / "full.ortcp")))


def test_pieces_placed_by_offset_when_present():
    full = fp16_full_state()
    assert_same(full, C.aggregate_states(legacy_fp16_states(full, 3, offsets=True)))


def test_our_mixed_precision_zero_files_keep_working(tmp_path):
    full = fp16_full_state()
    states = C.reshard_state(full, 3, zero_stage=1, flat_order=FLAT)  # whole fp32 weights on every rank
    assert all(s["model"]["full_precision"].keys() == full["model"]["full_precision"].keys() for s in states)
    assert_same(full, C.aggregate_states(states))
    paths = save_ranks(states, tmp_path)
    assert_same(full, C.load(C.aggregate_to_file(paths, tmp_path / "full.ortcp")))


def test_non_tiling_pieces_name_the_weight_and_ranks(tmp_path):
    states = legacy_fp16_states(fp16_full_state(), 3)
    states[1]["model"]["full_precision"]["w2"] = states[1]["model"]["full_precision"]["w2"][:15]
    message = r"'model/full_precision/w2': ZeRO pieces do not tile its 96 elements: gap \[91, 96\); pieces: "
    pieces = r"rank 1 \(states\[1\]\) \[0, 15\), rank 2 \(states\[2\]\) \[15, 91\)"
    with pytest.raises(C.AggregationError, match=message + pieces):
        C.aggregate_states(states)
    states = legacy_fp16_states(fp16_full_state(), 3)
    del states[0]["model"]["full_precision"]["w1"]  # rank 1's piece alone is too short
    with pytest.raises(C.AggregationError, match=r"'model/full_precision/w1': ZeRO pieces do not tile its 224 "):
        C.aggregate_states(states)
    paths = save_ranks(legacy_fp16_states(fp16_full_state(), 2), tmp_path)
    bad = C.load(paths[0])
    bad["model"]["full_precision"]["w1"] = torch.cat([bad["model"]["full_precision"]["w1"], torch.zeros(3)])
    paths[0].unlink()
    C.save(bad, paths[0])
    with pytest.raises(C.AggregationError, match=r"'model/full_precision/w1': .*pieces end at 227, past 224"):
        C.aggregate_to_file(paths, tmp_path / "out.ortcp")
    assert not list(tmp_path.glob("*out.ortcp*"))


def test_weight_held_by_no_rank_is_named():
    states = legacy_fp16_states(fp16_full_state(), 3)
    del states[2]["model"]["full_precision"]["b2"]  # its owner lost it
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    assert (
        "'model/full_precision/b2' is not held by any rank (with ZeRO and mixed_precision each fp32 weight is "
        "kept whole by its owner or in 1-D pieces by the ranks it straddles); it has optimizer state on rank 2 "
        "(states[2])"
    ) in str(info.value)


def test_whole_weight_on_several_ranks_must_be_identical():
    states = legacy_fp16_states(fp16_full_state(), 3)
    b2 = states[2]["model"]["full_precision"]["b2"]
    states[0]["model"]["full_precision"]["b2"] = b2.clone()  # an equal extra copy is fine
    assert_same(fp16_full_state(), C.aggregate_states(states))
    states[1]["model"]["full_precision"]["b2"] = b2 + 1
    message = r"'model/full_precision/b2' on rank 1 \(states\[1\]\) differs from rank 0"
    with pytest.raises(C.AggregationError, match=message):
        C.aggregate_states(states)


def test_whole_weight_next_to_pieces_is_refused():
    states = legacy_fp16_states(fp16_full_state(), 2)
    states[0]["model"]["full_precision"]["w1"] = fp16_full_state()["model"]["full_precision"]["w1"]
    with pytest.raises(C.AggregationError, match=r"'model/full_precision/w1' is whole on rank 0 .* but ZeRO pieces on"):
        C.aggregate_states(states)


def test_without_mixed_precision_missing_weights_still_error():
    states = legacy_fp16_states(fp16_full_state(), 3)
    for s in states:
        s["trainer_options"]["mixed_precision"] = False
    with pytest.raises(C.AggregationError) as info:
        C.aggregate_states(states)
    message = str(info.value)
    assert "'model/full_precision/b2' is missing on rank 0 (states[0]), rank 1 (states[1])" in message
    assert "'model/full_precision/b1' is missing on rank 0 (states[0]), rank 2 (states[2])" in message
    # full-precision ZeRO keeps whole weights: 1-D pieces are not concatenated
    assert "'model/full_precision/w1' is missing on rank 2 (states[2])" in message
    assert "'model/full_precision/w1': expected shape (16, 14) (whole: fp32 weights are ZeRO pieces only" in message


def test_mixed_precision_without_zero_needs_every_weight_everywhere():
    full = fp16_full_state()
    states = copy.deepcopy(C.reshard_state(full, 2, zero_stage=0))
    del states[1]["model"]["full_precision"]["w2"]
    with pytest.raises(C.AggregationError, match=r"'model/full_precision/w2' is missing on rank 1 \(states\[1\]\)"):
        C.aggregate_states(states)
