"""user_dict encoding without pickle, the schema records, and their errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from ort_trainer import checkpoint as C
from tests.builders import legacy_trainer_options


class Custom:
    def __eq__(self, other):
        return isinstance(other, Custom)


USER_DICT = {
    "epoch": 3,
    "note": "légacy",
    "lr": 1e-3,
    "flag": True,
    "nothing": None,
    "raw": b"\x00\x01",
    "ints": [1, 2],
    "pair": (1, 2),
    "mixed": [1, "a", None, [2.5, (3, "b")], {"k": np.int64(4)}],
    "nested": {"a": {"b": {}}, "x/y": 1},
    "np": np.arange(4, dtype=np.float32),
    "np_scalar": np.float64(2.5),
    "tensor": torch.arange(3),
    "bf16": torch.ones(2, dtype=torch.bfloat16),
    "tagged_key": {"__list__": 1},
    "empty_list": [],
    "empty_tuple": (),
}


def assert_exact(expected, got, where="user_dict"):
    assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_exact(expected[key], got[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert_exact(e, g, f"{where}/{i}")
    elif isinstance(expected, np.ndarray | np.generic):
        assert got.dtype == expected.dtype and np.array_equal(got, expected), where
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    else:
        assert got == expected, where


def test_user_dict_round_trips_with_python_types(tmp_path):
    C.save({"user_dict": C.encode_user_dict(USER_DICT)}, tmp_path / "u.ortcp")
    loaded = C.load(tmp_path / "u.ortcp", "user_dict")
    assert_exact(USER_DICT, C.decode_user_dict(loaded))


def test_unsupported_user_values_name_the_key_path():
    with pytest.raises(TypeError, match=r"unsupported user_dict value of type .*Custom at 'user_dict/opt/foo'"):
        C.encode_user_dict({"opt": {"foo": Custom()}})
    with pytest.raises(TypeError, match=r"builtins.set at 'user_dict/l/1'"):
        C.encode_user_dict({"l": [1, {2}]})
    with pytest.raises(TypeError, match=r"user_dict keys must be str or int, got \[1.5\] at 'user_dict/d'"):
        C.encode_user_dict({"d": {1.5: "x"}})
    with pytest.raises(TypeError, match="user_dict must be a Mapping, got list"):
        C.encode_user_dict([1])


def test_pickle_only_with_explicit_flag(tmp_path):
    value = {"obj": Custom(), "d": {(1, 2): 2}, "plain": 1}  # tuple keys: only with pickle
    encoded = C.encode_user_dict(value, allow_pickle=True)
    assert encoded["plain"] == 1 and set(encoded["obj"]) == {"__pickle__"}
    C.save({"user_dict": encoded}, tmp_path / "p.ortcp")
    tree = C.load(tmp_path / "p.ortcp", "user_dict")
    with pytest.raises(C.CheckpointPickleError, match=r"p.ortcp: 'user_dict/d' holds pickled data.*allow_pickle=True"):
        C.decode_user_dict(tree, source=str(tmp_path / "p.ortcp"))
    assert C.decode_user_dict(tree, allow_pickle=True) == value


def test_legacy_hex_user_dict():
    hexed = pickle.dumps({"epoch": 1}).hex()
    for form in (hexed, hexed.encode()):
        with pytest.raises(C.CheckpointPickleError, match=r"ckpt.ortcp: 'user_dict' holds pickled data"):
            C.decode_user_dict(form, source="ckpt.ortcp")
        assert C.decode_user_dict(form, allow_pickle=True) == {"epoch": 1}
    with pytest.raises(C.CheckpointFormatError, match="not a hex string"):
        C.decode_user_dict("zz", allow_pickle=True)
    with pytest.raises(C.CheckpointFormatError, match=r"malformed list at 'user_dict/l'"):
        C.decode_user_dict({"l": {"__list__": {"0": 1, "2": 2}}})


# ---- schema records -----------------------------------------------------------------------------
OPTIONS = legacy_trainer_options(
    zero_stage=1, world_rank=1, world_size=4, optimizer_name="LambOptimizer", data_parallel_size=4
)


def test_trainer_options_record_accepts_legacy_value_types():
    legacy = OPTIONS | {"mixed_precision": np.bool_(False), "zero_stage": np.int64(1), "world_size": torch.tensor(4)}
    record = C.TrainerOptionsRecord.from_tree(legacy | {"optimizer_name": b"LambOptimizer"})
    assert record.to_tree() == OPTIONS
    assert type(record.to_tree()["zero_stage"]) is int


def test_trainer_options_record_lists_every_problem():
    with pytest.raises(ValueError, match=r"missing keys \['world_size'\], unknown keys \['extra'\]; valid keys are"):
        C.TrainerOptionsRecord.from_tree({k: v for k, v in OPTIONS.items() if k != "world_size"} | {"extra": 1})
    with pytest.raises(TypeError, match=r"mixed_precision: expected bool, got int 1; zero_stage: expected int, got"):
        C.TrainerOptionsRecord(**OPTIONS | {"mixed_precision": 1, "zero_stage": "1"})
    with pytest.raises(ValueError, match=r"world_rank: expected 0 <= rank < world_size=4, got 4"):
        C.TrainerOptionsRecord(**OPTIONS | {"world_rank": 4})


def test_partition_info_legacy_round_trip():
    legacy = {"original_dim": torch.tensor([16, 20]), "megatron_row_partition": torch.tensor([1])}
    info = C.PartitionInfo.from_tree(legacy)
    assert info == C.PartitionInfo(original_dim=(16, 20), megatron_row_partition=1)
    assert info.to_tree() == {"original_dim": [16, 20], "megatron_row_partition": [1]}
    zero = C.PartitionInfo.from_tree({"original_dim": [4, 4], "megatron_row_partition": [-1], "offset": 8})
    assert zero.offset == 8 and zero.to_tree()["offset"] == 8
    with pytest.raises(ValueError, match=r"megatron_row_partition: expected -1, 0 or 1, got 2"):
        C.PartitionInfo(original_dim=(2,), megatron_row_partition=2)
    with pytest.raises(TypeError, match=r"original_dim: expected a tuple of int"):
        C.PartitionInfo(original_dim=[2])
