"""Files written in format version 1 (zlib CRC-32 per dataset, before CRC-32C) still load and verify.

The fixtures in ``tests/fixtures/format_v1`` were written by commit a94ec31 (see the README there);
``produce.py`` beside them holds the tree they were written from.
"""

from __future__ import annotations

import importlib.util

import h5py
import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.cli._main import main as cli_main
from tests.paths import FIXTURES

V1 = FIXTURES / "format_v1"
TREE_FILE = V1 / "tree_crc32.ortcp"
TRAINER_FILE = V1 / "trainer_mlp_crc32.ortcp"


def _fixture_tree():
    spec = importlib.util.spec_from_file_location("format_v1_produce", V1 / "produce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fixture_tree()


def _assert_same(got, want, where="/"):
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}{key}/")
    elif isinstance(want, torch.Tensor | np.ndarray):
        want = torch.as_tensor(want)
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    else:
        assert type(got) is type(want) and got == want, where


def test_v1_tree_loads_identically_and_verifies():
    with C.open_checkpoint(TREE_FILE) as reader:
        assert reader.format_version == 1 and not reader.is_legacy
        assert reader.verify() == 26
    _assert_same(C.load(TREE_FILE), _fixture_tree())
    assert C.load(TREE_FILE, ("odd/key%name", ".")) == 1


def test_v1_damage_is_still_detected(tmp_path):
    """The CRC-32 of a version-1 file is checked, not ignored: flip one byte of a tensor."""
    victim = tmp_path / "v1.ortcp"
    victim.write_bytes(TREE_FILE.read_bytes())
    with h5py.File(victim, "r") as f:
        offset = f["model/full_precision/emb"].id.get_offset()
    data = bytearray(victim.read_bytes())
    data[offset + 100] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(C.CheckpointCorruptError, match=r"v1.ortcp: checksum mismatch in 1 dataset.*emb"):
        C.load(victim)


def test_v1_trainer_checkpoint_loads_into_a_trainer():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    desc = {"inputs": [("x", ["batch", 6]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)
    user_dict = trainer.load_checkpoint(TRAINER_FILE)
    assert user_dict == {"epoch": 2, "note": "format v1"}
    stored = C.load(TRAINER_FILE)
    state = trainer.state_dict()
    for name, weight in stored["model"]["full_precision"].items():
        assert torch.equal(state["model"]["full_precision"][name], weight), name
    assert stored["train_step_info"]["step"] == 3
    assert "seed" not in stored["train_step_info"]  # written before runs had a dropout seed
    loaded = dict(state["train_step_info"])
    assert loaded.pop("seed") == 5  # the documented fallback: the trainer keeps its own seed (torch's)
    assert loaded == stored["train_step_info"]


def test_v1_files_pass_cli_verify(capsys):
    assert cli_main(["verify", str(TREE_FILE), str(TRAINER_FILE)]) == 0
    out = capsys.readouterr().out
    assert "tree_crc32.ortcp: 26 datasets, checksums match" in out
    assert "trainer_mlp_crc32.ortcp: 27 datasets, checksums match" in out
