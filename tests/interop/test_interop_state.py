"""State dicts a PyTorch user can rely on: complete from construction, validated at the call, torch-shaped results.

Covers: the optimizer section before the first step (and DCP / Stateful loads into unbuilt trainers),
Update_Count checks, `_IncompatibleKeys` from non-strict loads, every check at the call (before the
first step too), bad values named by key, modules with ``_extra_state``, and the StateDictOptions.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions as TorchStateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ort_trainer import StateDictOptions, optim
from tests.builders import mlp_trainer
from tests.models import MLP, mlp_batches
from tests.trees import assert_trees_equal, tree_structure

ce = torch.nn.functional.cross_entropy
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def _trainer(model=None, config=None, seed=0, **options):
    torch.manual_seed(seed)
    scheduler = optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=20, warmup=0.2)
    options = {"lr_scheduler": scheduler, **options}
    return mlp_trainer(model, config=config or optim.AdamConfig(lr=0.02, lambda_coef=0.01), seed=None, **options)


# ---------------------------------------------------------------------------- complete from construction (point 2)
def test_state_dict_is_complete_before_the_first_step_and_keeps_its_layout():
    trainer = _trainer()
    before = trainer.state_dict()
    assert set(before) == {"model", "optimizer", "trainer_options", "train_step_info", "lr_scheduler"}
    assert list(before["optimizer"]) == NAMES
    for name in NAMES:
        entry = before["optimizer"][name]
        assert entry["Update_Count"].tolist() == [1]
        assert not entry["Moment_1"].any() and not entry["Moment_2"].any()
    trainer.train_step(*mlp_batches(1)[0])
    assert tree_structure(trainer.state_dict()) == tree_structure(before)


def _fill_like_dcp(template, saved):
    """What dcp.load does: the destination's own state_dict() decides which keys are loaded."""
    if isinstance(template, dict):
        return {k: _fill_like_dcp(v, saved[k]) for k, v in template.items()}
    return copy.deepcopy(saved)


def test_a_stateful_load_into_an_unbuilt_trainer_keeps_the_optimizer_state():
    batches = mlp_batches(8)
    source = _trainer()
    for batch in batches[:4]:
        source.train_step(*batch)
    fresh = _trainer(seed=5)
    fresh.load_state_dict(_fill_like_dcp(fresh.state_dict(), source.state_dict()))
    expected = [source.train_step(*b).item() for b in batches[4:]]
    assert [fresh.train_step(*b).item() for b in batches[4:]] == expected
    assert_trees_equal(fresh.state_dict(), source.state_dict())


def test_dcp_save_and_load_with_the_trainer_as_a_stateful(tmp_path):
    batches = mlp_batches(8)
    source = _trainer()
    for batch in batches[:4]:
        source.train_step(*batch)
    dcp.save({"trainer": source}, checkpoint_id=tmp_path / "dcp")
    fresh = _trainer(seed=5)
    dcp.load({"trainer": fresh}, checkpoint_id=tmp_path / "dcp")
    expected = [source.train_step(*b).item() for b in batches[4:]]
    assert [fresh.train_step(*b).item() for b in batches[4:]] == expected
    assert_trees_equal(fresh.state_dict(), source.state_dict())


# ---------------------------------------------------------------------------- Update_Count (point 5)
def test_an_update_count_off_by_one_is_refused():
    source = _trainer()
    for batch in mlp_batches(3):
        source.train_step(*batch)
    state = source.state_dict()
    state["optimizer"]["fc2.bias"]["Update_Count"] += 1
    for built in (False, True):
        target = _trainer(seed=1)
        if built:
            target.train_step(*mlp_batches(1)[0])
        before = target.state_dict()
        with pytest.raises(
            ValueError,
            match=r"state_dict\[optimizer\]\[fc2.bias\]\[Update_Count\] is 5, but "
            r"train_step_info.optimization_step is 3: it must be 4",
        ):
            target.load_state_dict(state)
        assert_trees_equal(target.state_dict(), before)


def test_an_optimizer_section_alone_must_match_the_trainers_own_step():
    source = _trainer()
    for batch in mlp_batches(2):
        source.train_step(*batch)
    target = _trainer(seed=1)
    with pytest.raises(ValueError, match=r"\[Update_Count\] is 3, but train_step_info.optimization_step is 0"):
        target.load_state_dict({"optimizer": source.state_dict()["optimizer"]}, strict=False)


# ---------------------------------------------------------------------------- _IncompatibleKeys (point 6)
def test_non_strict_loads_return_incompatible_keys():
    trainer = _trainer()
    plain = MLP().state_dict()
    del plain["fc2.bias"]
    plain["extra.weight"] = torch.zeros(2)
    result = trainer.load_state_dict(plain, strict=False)
    assert isinstance(result, _IncompatibleKeys)
    assert (result.missing_keys, result.unexpected_keys) == (["fc2.bias"], ["extra.weight"])
    state = trainer.state_dict()
    del state["optimizer"]["fc1.bias"]
    state["model"]["full_precision"]["zzz"] = torch.zeros(1)
    result = trainer.load_state_dict(state, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["optimizer/fc1.bias"], ["model/full_precision/zzz"])
    assert trainer.load_state_dict(trainer.state_dict()) == _IncompatibleKeys([], [])


# ---------------------------------------------------------------------------- checks at the call (issue 12, 7 and 8)
def _edit(path, value):
    def edit(state):
        node = state
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return edit


BAD_STATES = {
    "extra key": (
        _edit(("model", "full_precision", "extra"), torch.zeros(2)),
        r"unexpected keys in state_dict\[model\]\[full_precision\]: \['extra'\]",
    ),
    "missing key": (
        _edit(("model", "full_precision", "fc1.bias"), KeyError),
        r"missing keys in state_dict\[model\]\[full_precision\]: \['fc1.bias'\]",
    ),
    "int dtype": (
        _edit(("model", "full_precision", "fc1.bias"), torch.zeros(16, dtype=torch.int64)),
        r"state_dict\[model\]\[full_precision\]\[fc1.bias\] must be floating point, got torch.int64",
    ),
    "list value": (
        _edit(("model", "full_precision", "fc1.bias"), [0.0] * 16),
        r"state_dict\[model\]\[full_precision\]\[fc1.bias\] must be a tensor, got list",
    ),
    "negative step": (_edit(("train_step_info", "step"), -1), r"'step' must be an int >= 0, got -1"),
    "wrong optimizer": (
        _edit(("trainer_options", "optimizer_name"), "LambOptimizer"),
        r"optimizer mismatch: the state was saved with 'LambOptimizer'",
    ),
    "unknown section": (_edit(("modle",), {}), r"unexpected keys in state_dict: \['modle'\]"),
    "meta tensor": (
        _edit(("optimizer", "fc1.weight", "Moment_1"), torch.empty(16, 20, device="meta")),
        r"state_dict\[optimizer\]\[fc1.weight\]\[Moment_1\] is a meta tensor \(no data\)",
    ),
    "sparse tensor": (
        _edit(("model", "full_precision", "fc2.weight"), torch.zeros(4, 16).to_sparse()),
        r"state_dict\[model\]\[full_precision\]\[fc2.weight\] is a sparse tensor",
    ),
}


@pytest.fixture(scope="module")
def trained_state():
    """The state of a trainer after one step: every case below loads a damaged copy of it."""
    source = _trainer()
    source.train_step(*mlp_batches(1)[0])
    return copy.deepcopy(source.state_dict())


@pytest.mark.parametrize("built", [False, True], ids=["before-first-step", "after-first-step"])
@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_every_check_happens_at_the_call_and_a_failed_load_changes_nothing(trained_state, case, built):
    edit, pattern = BAD_STATES[case]
    state = copy.deepcopy(trained_state)
    edit(state)
    target = _trainer(seed=1)
    if built:
        target.train_step(*mlp_batches(1)[0])
    before = target.state_dict()
    with pytest.raises((KeyError, ValueError, TypeError), match=pattern):
        target.load_state_dict(state)
    assert_trees_equal(target.state_dict(), before)
    target.train_step(*mlp_batches(2)[1])  # nothing is left pending


def test_bad_values_in_a_pytorch_format_dict_are_named():
    trainer = _trainer()
    plain = MLP().state_dict()
    with pytest.raises(ValueError, match=r"state_dict\[fc1.weight\] is a meta tensor"):
        trainer.load_state_dict({**plain, "fc1.weight": torch.empty(16, 20, device="meta")})
    with pytest.raises(TypeError, match=r"state_dict\[fc1.bias\] is a sparse tensor"):
        trainer.load_state_dict({**plain, "fc1.bias": torch.zeros(16).to_sparse()})
    renamed = dict(plain)
    renamed["fc1.w"] = renamed.pop("fc1.weight")
    with pytest.raises(
        KeyError,
        match=r"missing keys in the PyTorch state_dict: \['fc1.weight'\]; "
        r"unexpected keys in the PyTorch state_dict: \['fc1.w'\]",
    ):
        trainer.load_state_dict(renamed)


# ---------------------------------------------------------------------------- _extra_state (point 7)
class Calibrated(torch.nn.Linear):
    """A layer with extra (non-tensor) state, as quantization observers and some HF layers have."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calibration = {"scale": 0.5, "version": 1, "table": torch.arange(3.0)}

    def get_extra_state(self):
        return self.calibration

    def set_extra_state(self, state):
        self.calibration = state


class MLPWithExtraState(MLP):
    def __init__(self):
        super().__init__()
        self.fc2 = Calibrated(16, 4)

    def get_extra_state(self):
        return {"epoch_seen": 7}

    def set_extra_state(self, state):
        self.seen = state


def test_a_module_with_extra_state_trains_and_round_trips_it(tmp_path):
    torch.manual_seed(0)
    model = MLPWithExtraState()
    plain = MLP()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
    trainer = _trainer(model)
    reference = _trainer(plain)
    for batch in mlp_batches(4):
        assert trainer.train_step(*batch).item() == reference.train_step(*batch).item()
    weights = trainer.state_dict(pytorch_format=True)
    assert list(weights) == list(model.state_dict()) == ["_extra_state", *NAMES, "fc2._extra_state"]
    assert weights["_extra_state"] == {"epoch_seen": 7}
    assert_trees_equal(weights["fc2._extra_state"], model.fc2.calibration)
    trainer.save_checkpoint(tmp_path / "x.ortcp")
    other = MLPWithExtraState()
    other.fc2.calibration = {"scale": 9.0}
    loaded = _trainer(other, seed=4)
    loaded.load_checkpoint(tmp_path / "x.ortcp")
    target = MLPWithExtraState()
    target.load_state_dict(loaded.state_dict(pytorch_format=True), strict=True)
    assert_trees_equal(target.fc2.calibration, model.fc2.calibration)
    assert target.seen == {"epoch_seen": 7}


# ---------------------------------------------------------------------------- StateDictOptions
def test_state_dict_options_ignore_frozen_params_cpu_offload_and_submodules():
    trainer = _trainer(utils={"frozen_weights": ["fc1.bias"]})
    trainer.train_step(*mlp_batches(1)[0])
    weights = trainer.state_dict(pytorch_format=True, options=StateDictOptions(ignore_frozen_params=True))
    assert list(weights) == ["fc1.weight", "fc2.weight", "fc2.bias"]
    state = trainer.state_dict(options=TorchStateDictOptions(ignore_frozen_params=True, cpu_offload=True))
    assert sorted(state["model"]["full_precision"]) == ["fc1.weight", "fc2.bias", "fc2.weight"]
    fresh = _trainer(seed=2, utils={"frozen_weights": ["fc1.bias"]})
    fresh.load_state_dict(state, options=StateDictOptions(ignore_frozen_params=True))  # frozen keys may be absent
    assert_trees_equal(fresh.state_dict(options=StateDictOptions(ignore_frozen_params=True)), state)
    sub = trainer.state_dict(pytorch_format=True, submodules=["fc2"])
    assert list(sub) == ["fc2.weight", "fc2.bias"]
    no_prefix = trainer.state_dict(
        pytorch_format=True,
        submodules=[trainer_module(trainer).fc2],
        options=StateDictOptions(keep_submodule_prefixes=False),
    )
    assert list(no_prefix) == ["weight", "bias"]
    assert_trees_equal(no_prefix["weight"], sub["fc2.weight"])
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict"):
        trainer.state_dict(options=StateDictOptions(flatten_optimizer_state_dict=True))
    with pytest.raises(ValueError, match=r"submodules: 'fc9' is not a submodule"):
        trainer.state_dict(pytorch_format=True, submodules=["fc9"])


def trainer_module(trainer):
    return trainer.trainer_state.model


def test_full_state_dict_of_a_single_process_is_the_state_dict():
    trainer = _trainer()
    trainer.train_step(*mlp_batches(1)[0])
    assert_trees_equal(trainer.state_dict(options=StateDictOptions(full_state_dict=True)), trainer.state_dict())
