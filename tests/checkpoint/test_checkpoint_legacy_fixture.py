"""A checkpoint written by the real legacy ORTTrainer (onnxruntime-training 1.16.3) loads with the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ort_trainer import checkpoint as C
from tests.paths import LEGACY_CHECKPOINT as LEGACY
from tests.paths import LEGACY_STATE_NPZ as EXPECTED


def _get(tree, path):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def test_arrays_equal_the_npz():
    state = C.load(LEGACY)
    expected = np.load(EXPECTED)
    assert len(expected.files) == 16
    for key in expected.files:
        got = _get(state, key)
        assert isinstance(got, torch.Tensor), key
        assert got.dtype == torch.from_numpy(expected[key]).dtype and tuple(got.shape) == expected[key].shape, key
        assert np.array_equal(got.numpy(), expected[key]), key
    assert sorted(state["model"]["full_precision"]) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert state["optimizer"]["fc1.weight"]["Update_Count"].tolist() == [9]


def test_trainer_options_and_step_info_are_python_values(trainer_options):
    state = C.load(LEGACY)
    assert state["trainer_options"] == trainer_options
    assert type(state["trainer_options"]["optimizer_name"]) is str
    assert type(state["trainer_options"]["mixed_precision"]) is bool
    assert state["train_step_info"] == {"optimization_step": 8, "step": 8}
    record = C.TrainerOptionsRecord.from_tree(state["trainer_options"])
    assert record.optimizer_name == "AdamOptimizer" and record.world_size == 1
    assert C.load(LEGACY, "trainer_options/optimizer_name") == "AdamOptimizer"


def test_user_dict_pickle_refused_by_default():
    raw = C.load(LEGACY, "user_dict")
    assert isinstance(raw, str) and raw.startswith("80")
    message = r"mlp_adam_default.ortcp: 'user_dict' holds pickled data; .*execute arbitrary code.*allow_pickle=True"
    with pytest.raises(C.CheckpointPickleError, match=message):
        C.decode_user_dict(raw, source=str(LEGACY))
    assert C.decode_user_dict(raw, allow_pickle=True) == {"epoch": 3, "note": "legacy"}


def test_reader_reports_legacy_and_reads_into_buffers():
    with C.open_checkpoint(LEGACY) as reader:
        assert reader.is_legacy and reader.format_version == C.LEGACY_FORMAT_VERSION == 0
        assert reader.attrs == {}
        assert reader.verify() == 0  # legacy files carry no checksums
        assert reader.tree_info("model/full_precision/fc1.weight") == ((16, 20), torch.float32)
        assert reader.tree_info("trainer_options/optimizer_name") == ((), str)
        assert reader.tree_info("train_step_info/step") == ((), int)
        flat = torch.zeros(16 * 20 + 16)
        reader.read_into("model/full_precision/fc1.weight", flat[:320].view(16, 20))
        reader.read_into("model/full_precision/fc1.bias", flat[320:])
    expected = np.load(EXPECTED)
    assert np.array_equal(flat[:320].view(16, 20).numpy(), expected["model/full_precision/fc1.weight"])
    assert np.array_equal(flat[320:].numpy(), expected["model/full_precision/fc1.bias"])


def test_resave_in_our_format_keeps_legacy_layout(tmp_path):
    state = C.load(LEGACY)
    state.pop("user_dict")
    C.save(state, tmp_path / "ours.ortcp")
    again = C.load(tmp_path / "ours.ortcp")
    for key in np.load(EXPECTED).files:
        assert torch.equal(_get(again, key), _get(state, key)), key
    assert again["trainer_options"] == state["trainer_options"]
