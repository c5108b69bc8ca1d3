"""Trainer state: state_dict / load_state_dict, checkpoints, resume equivalence, the legacy fixture."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.builders import legacy_trainer_options, mlp_trainer
from tests.models import CNN, CNN_DESC, MLP, MLP_DESC, cnn_batches, mlp_batches
from tests.paths import LEGACY_FIXTURES as FIXTURES

ce = torch.nn.functional.cross_entropy
REPO = Path(__file__).resolve().parents[2]


def _trainer(model=None, config=None, **options):
    return mlp_trainer(model, config=config, **options)


# ---------------------------------------------------------------------------- resume in a fresh process
@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """Uninterrupted and split runs in one process, the resumed halves in a second, fresh one."""
    folder = tmp_path_factory.mktemp("resume")
    for phase in ("first", "resume"):
        cmd = [sys.executable, "-m", "tests.trainer.resume_worker", phase, str(folder)]
        done = subprocess.run(cmd, cwd=REPO, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.processes
@pytest.mark.parametrize("name", ["adam", "lamb", "sgd"])
def test_resume_in_fresh_process_is_bit_identical(resume_runs, name):
    """N steps == k steps + save + load in a new process + N-k steps (LR schedule, accumulation 2)."""
    full, first, resumed = (checkpoint.load(resume_runs / f"{name}-{part}.h5") for part in ("full", "first", "resumed"))
    assert resumed["train_step_info"] == full["train_step_info"] == {"optimization_step": 6, "step": 12, "seed": 0}
    assert resumed["lr"] == full["lr"]
    torch.testing.assert_close(torch.cat([first["losses"], resumed["losses"]]), full["losses"], atol=0, rtol=0)
    _assert_trees_equal(full["model"], resumed["model"])
    _assert_trees_equal(full.get("optimizer", {}), resumed.get("optimizer", {}))
    assert full["lr_scheduler"] == resumed["lr_scheduler"]


def _assert_trees_equal(a, b, path="state"):
    assert set(a) == set(b), f"{path}: keys differ"
    for key in a:
        if isinstance(a[key], dict):
            _assert_trees_equal(a[key], b[key], f"{path}/{key}")
        elif isinstance(a[key], torch.Tensor | np.ndarray):
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), f"{path}/{key} differs"
        else:
            assert a[key] == b[key], f"{path}/{key} differs"


# ---------------------------------------------------------------------------- state_dict
def test_state_dict_layout_and_copies():
    trainer = _trainer()
    trainer.train_step(*mlp_batches(1)[0])
    state = trainer.state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert set(state["model"]["full_precision"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert set(state["optimizer"]["fc1.weight"]) == {"Moment_1", "Moment_2", "Update_Count"}
    assert state["optimizer"]["fc1.weight"]["Update_Count"].tolist() == [2]
    assert state["trainer_options"] == legacy_trainer_options()
    assert state["train_step_info"] == {"optimization_step": 1, "step": 1, "seed": 0}
    state["model"]["full_precision"]["fc1.weight"].zero_()  # a copy: training is not affected
    assert trainer.state_dict()["model"]["full_precision"]["fc1.weight"].abs().sum() > 0


def test_state_dict_before_first_step_holds_initial_weights():
    torch.manual_seed(0)
    model = MLP()
    trainer = ORTTrainer(model, MLP_DESC, optim.AdamConfig(), loss_fn=ce)
    weights = trainer.state_dict()["model"]["full_precision"]
    assert torch.equal(weights["fc1.weight"], model.fc1.weight.detach())
    assert trainer.state_dict(pytorch_format=True).keys() == model.state_dict().keys()


def test_pytorch_format_loads_into_original_module_strictly():
    torch.manual_seed(0)
    model = CNN()
    trainer = ORTTrainer(model, CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    for batch in cnn_batches(3):
        trainer.train_step(*batch)
    fresh = CNN()
    fresh.load_state_dict(trainer.state_dict(pytorch_format=True), strict=True)
    assert fresh.bn.num_batches_tracked.item() == 3
    x, label = cnn_batches(1)[0]
    fresh.eval()
    torch.testing.assert_close(trainer.eval_step(x, label), ce(fresh(x), label).detach(), atol=1e-5, rtol=1e-5)


def test_load_plain_pytorch_state_dict():
    trainer = _trainer()
    trainer.train_step(*mlp_batches(1)[0])
    other = MLP()
    trainer.load_state_dict(other.state_dict())
    got = trainer.state_dict(pytorch_format=True)
    for name, value in other.state_dict().items():
        assert torch.equal(got[name], value)
    with pytest.raises(KeyError, match="unexpected keys in the PyTorch state_dict: \\['fc9.weight'\\]"):
        trainer.load_state_dict({**other.state_dict(), "fc9.weight": torch.zeros(1)})


def test_strict_load_reports_every_missing_and_unexpected_key_and_changes_nothing():
    trainer = _trainer()
    trainer.train_step(*mlp_batches(1)[0])
    before = trainer.state_dict()
    bad = copy.deepcopy(before)
    del bad["model"]["full_precision"]["fc2.bias"]
    del bad["model"]["full_precision"]["fc1.bias"]
    bad["model"]["full_precision"]["extra"] = torch.zeros(2)
    with pytest.raises(
        KeyError,
        match=r"missing keys in state_dict\[model\]\[full_precision\]: \['fc1.bias', 'fc2.bias'\].*"
        r"unexpected keys in state_dict\[model\]\[full_precision\]: \['extra'\]",
    ):
        trainer.load_state_dict(bad)
    shaped = copy.deepcopy(before)
    shaped["model"]["full_precision"]["fc1.weight"] = torch.zeros(3, 3)
    shaped["train_step_info"]["step"] = 99
    with pytest.raises(
        ValueError,
        match=r"shape mismatch for state_dict\[model\]\[full_precision\]\[fc1.weight\]: "
        r"checkpoint has \(3, 3\), model has \(16, 20\)",
    ):
        trainer.load_state_dict(shaped)
    wrong_opt = copy.deepcopy(before)
    wrong_opt["optimizer"]["fc1.weight"]["Moment_1"] = torch.zeros(2)
    with pytest.raises(ValueError, match="fc1.weight"):
        trainer.load_state_dict(wrong_opt)
    lamb = copy.deepcopy(before)
    lamb["trainer_options"]["optimizer_name"] = "LambOptimizer"
    with pytest.raises(ValueError, match="optimizer mismatch: the state was saved with 'LambOptimizer'"):
        trainer.load_state_dict(lamb)
    _assert_trees_equal(trainer.state_dict(), before)  # every failed load left the trainer as it was


def test_load_before_first_step_is_applied_at_build_including_counters():
    source = _trainer()
    for batch in mlp_batches(3):
        source.train_step(*batch)
    state = source.state_dict()
    target = _trainer(model=MLP())
    target.load_state_dict(state)
    assert target.state_dict()["train_step_info"] == state["train_step_info"]  # what will be applied
    target.train_step(*mlp_batches(4)[3])
    source.train_step(*mlp_batches(4)[3])
    _assert_trees_equal(target.state_dict(), source.state_dict())


# ---------------------------------------------------------------------------- checkpoint files
def test_checkpoint_round_trip_with_user_dict(tmp_path):
    trainer = _trainer()
    for batch in mlp_batches(2):
        trainer.train_step(*batch)
    path = tmp_path / "ckpt.ortcp"
    user = {"epoch": 3, "note": "hi", "history": [1.5, 2.5], "arr": np.arange(3), "nested": {"ok": True}}
    trainer.save_checkpoint(path, user_dict=user)
    with pytest.raises(checkpoint.CheckpointExistsError):
        trainer.save_checkpoint(path)
    trainer.save_checkpoint(path, overwrite=True, user_dict=user)
    other = _trainer(model=MLP())
    got = other.load_checkpoint(path)
    assert got["epoch"] == 3 and got["note"] == "hi" and got["history"] == [1.5, 2.5] and got["nested"] == {"ok": True}
    np.testing.assert_array_equal(got["arr"], np.arange(3))
    other.train_step(*mlp_batches(3)[2])
    trainer.train_step(*mlp_batches(3)[2])
    _assert_trees_equal(other.state_dict(), trainer.state_dict())


def test_checkpoint_without_optimizer_states(tmp_path):
    trainer = _trainer()
    trainer.train_step(*mlp_batches(1)[0])
    trainer.save_checkpoint(tmp_path / "w.ortcp", include_optimizer_states=False)
    assert "optimizer" not in checkpoint.load(tmp_path / "w.ortcp")
    with pytest.raises(TypeError, match="user_dict"):
        trainer.save_checkpoint(tmp_path / "x.ortcp", user_dict={"bad": object()})
    assert not (tmp_path / "x.ortcp").exists()


def test_corrupt_checkpoint_leaves_trainer_unchanged(tmp_path):
    trainer = _trainer()
    trainer.train_step(*mlp_batches(1)[0])
    path = tmp_path / "c.ortcp"
    trainer.save_checkpoint(path)
    data = bytearray(path.read_bytes())
    weight_bytes = trainer.state_dict()["model"]["full_precision"]["fc1.weight"].numpy().tobytes()
    offset = bytes(data).find(weight_bytes[:64])
    assert offset > 0
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    victim = _trainer(model=MLP())
    victim.train_step(*mlp_batches(1)[0])
    before = victim.state_dict()
    with pytest.raises(checkpoint.CheckpointCorruptError, match="c.ortcp"):
        victim.load_checkpoint(path)
    _assert_trees_equal(victim.state_dict(), before)


# ---------------------------------------------------------------------------- the real legacy checkpoint
def test_legacy_checkpoint_loads_into_equivalent_trainer():
    path = FIXTURES / "mlp_adam_default.ortcp"
    expected = np.load(FIXTURES / "mlp_adam_default__state_dict.npz")
    trainer = _trainer(model=MLP(), config=optim.AdamConfig(lr=0.01))
    before = trainer.state_dict()
    with pytest.raises(checkpoint.CheckpointPickleError, match="allow_pickle=True"):
        trainer.load_checkpoint(path)
    _assert_trees_equal(trainer.state_dict(), before)  # the refused load changed nothing
    assert trainer.load_checkpoint(path, allow_pickle=True) == {"epoch": 3, "note": "legacy"}
    unbuilt = trainer.state_dict()
    trainer.train_step(*mlp_batches(1)[0])  # builds the graphs over the state loaded before...
    trainer2 = _trainer(model=MLP(), config=optim.AdamConfig(lr=0.01))
    trainer2.train_step(*mlp_batches(1)[0])
    trainer2.load_checkpoint(path, allow_pickle=True)  # ...and the built-trainer path
    state = trainer2.state_dict()
    _assert_trees_equal(unbuilt, state)  # ...which was exactly what the built trainer loads
    for key in expected.files:
        parts = key.split("/")
        value = state
        for part in parts:
            value = value[part]
        np.testing.assert_array_equal(np.asarray(value), expected[key], err_msg=key)
    assert state["train_step_info"] == {"optimization_step": 8, "step": 8, "seed": 0}  # the file has none: ours


def test_a_wrong_checkpoint_before_the_first_step_is_refused_and_never_silently_dropped():
    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(20, 8)
            self.fc2 = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    wide = _trainer()
    trainer = _trainer(model=Narrow())
    before = trainer.state_dict()
    with pytest.raises(ValueError, match=r"shape mismatch for state_dict\[model\]\[full_precision\]\[fc1.weight\]"):
        trainer.load_state_dict(wide.state_dict())
    # everything is checked at the call (nothing is left pending for the first step)
    with pytest.raises(KeyError, match=r"missing keys in state_dict\[model\]\[full_precision\]: \['fc1.bias'"):
        trainer.load_state_dict({"model": {"full_precision": {"fc1.weight": torch.zeros(8, 20)}}})
    _assert_trees_equal(trainer.state_dict(), before)
    trainer.train_step(*mlp_batches(1)[0])
    assert trainer.is_built and trainer.train_step_info.step == 1
