"""``CheckpointManager.save(state, step)`` / ``restore(state)`` with a custom loop's dict of objects.

Torch is the reference: every object's ``state_dict()`` after a restore equals the saved one bit for bit
(AdamW with ``step`` tensors and two parameter groups, SGD momentum, a cosine schedule, GradScaler, RNG
state, a sampler, the user's own object), and training on after a restore gives the weights of the run
that never stopped, bit for bit. Refusals name the key path and leave every object as it was.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle

import numpy as np
import pytest
import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointManager
from ort_trainer.checkpoint.format import schema as S
from ort_trainer.checkpoint.objects import RNGState, load_objects, save_objects
from tests.custom_loop import STEPS, make_loop, state_of, train, weights
from tests.trees import assert_trees_equal


class Mine:
    """The user's own object: a state_dict of tensors, numbers, strings, lists, dicts (int keys too)."""

    def __init__(self) -> None:
        self.value = {
            "ema": torch.arange(6, dtype=torch.float64).reshape(2, 3),
            "count": 3,
            "ratio": 0.25,
            "name": "run-a",
            "history": [1.5, 2.5, None, "x", (1, "two")],
            "by_epoch": {0: [0.5], 7: {"best": True}},
            "seen": np.array([3, 1, 2], dtype=np.int16),
            "big": 2**70,
        }

    def state_dict(self):
        return copy.deepcopy(self.value)

    def load_state_dict(self, state):
        self.value = copy.deepcopy(state)


def _states(state):
    return {name: copy.deepcopy(obj.state_dict()) for name, obj in state.items()}


def _sgd_loop():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    sgd = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": [*model[1].parameters(), *model[2].parameters()], "lr": 0.05}],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
    )
    return model, sgd


def _sgd_steps(model, sgd, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(6, 5, generator=gen)).pow(2).mean().backward()
        sgd.step()
        sgd.zero_grad()


def test_adamw_sgd_scheduler_scaler_rng_sampler_and_own_objects_round_trip_exactly(tmp_path):
    loop = make_loop()
    train(loop, 0, 4)
    model, sgd = _sgd_loop()
    _sgd_steps(model, sgd, 3, seed=5)
    state = {**state_of(loop), "model2": model, "sgd": sgd, "mine": Mine()}
    assert set(loop.optimizer.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    saved = _states(state)
    manager = CheckpointManager(tmp_path / "run")
    manager.save(state, 4, user_dict={"epoch": 2})

    fresh = make_loop(seed=1)
    fresh_model, fresh_sgd = _sgd_loop()
    train(fresh, 0, 1)  # some other state, to be replaced
    _sgd_steps(fresh_model, fresh_sgd, 1, seed=9)
    torch.manual_seed(123)
    target = {**state_of(fresh), "model2": fresh_model, "sgd": fresh_sgd, "mine": Mine()}
    target["mine"].value = {}
    restored = manager.restore(target)

    assert (restored.step, restored.user_dict) == (4, {"epoch": 2})
    assert_trees_equal(_states(target), saved)  # tensors bit for bit, python values with ==
    groups = fresh.optimizer.state_dict()["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and groups[0]["betas"] == (0.9, 0.999)
    assert fresh.optimizer.state_dict()["state"][0]["step"].dtype == torch.float32
    assert type(target["mine"].value["history"][4]) is tuple and target["mine"].value["big"] == 2**70
    assert fresh_sgd.state_dict()["param_groups"][0]["nesterov"] is True


def test_training_on_after_a_restore_equals_the_run_that_never_stopped(tmp_path):
    reference = make_loop()
    train(reference, 0, STEPS)

    first = make_loop()
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    train(first, 0, 7, after_step=lambda step: step % 3 == 0 and manager.save(state_of(first), step))
    train(first, 7, 8)  # steps after the last save are lost with the process
    assert [c.step for c in manager.checkpoints()] == [3, 6]

    torch.manual_seed(999)  # the resumed process starts with other generator states
    resumed = make_loop(seed=7)
    restored = CheckpointManager(tmp_path / "run").restore(state_of(resumed))
    assert restored.step == 6
    train(resumed, restored.step, STEPS)
    assert_trees_equal(weights(resumed), weights(reference))
    assert_trees_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict())
    # (loss scales are powers of 2: the weights alone would not show a scaler left unrestored)
    assert resumed.scaler.state_dict() == reference.scaler.state_dict()
    assert resumed.scheduler.state_dict() == reference.scheduler.state_dict()


def test_async_saves_copy_the_state_at_the_call_and_keep_rules_prune(tmp_path):
    loop = make_loop()
    manager = CheckpointManager(tmp_path / "run", keep_last=2, async_save=True)
    at_save = {}
    for step in range(1, 5):
        train(loop, step - 1, step)
        handle = manager.save(state_of(loop), step, metrics={"step": step})
        at_save[step] = weights(loop)
        with torch.no_grad():  # the loop goes on changing the weights while the save runs
            for p in loop.model.parameters():
                p.add_(1.0)
        handle.wait()
    manager.wait()
    assert [c.step for c in manager.checkpoints()] == [3, 4]
    other = make_loop(seed=5)
    assert manager.restore(state_of(other)).step == 4
    assert_trees_equal(weights(other), at_save[4])


def test_unsupported_values_are_a_type_error_naming_the_key_path_and_nothing_is_written(tmp_path):
    loop = make_loop()
    manager = CheckpointManager(tmp_path / "run")
    manager.save(state_of(loop), 1)
    before = (tmp_path / "run" / "ckpt-000000001.ortcp").read_bytes()
    mine = Mine()
    mine.value["history"].append({"seen": {1, 2}})  # a set: not storable without pickle
    with pytest.raises(TypeError, match=r"'stateful/mine/history/5/seen'"):
        manager.save({**state_of(loop), "mine": mine}, 2)
    mine.value = {object(): 1}
    with pytest.raises(TypeError, match=r"keys must be str or int.*'stateful/mine'"):
        manager.save({"mine": mine}, 2)
    with pytest.raises(TypeError, match=r"state\['bad'\] must have state_dict\(\) and load_state_dict\(\)"):
        manager.save({"bad": 3}, 2)
    with pytest.raises(ValueError, match="step is required"):
        manager.save(state_of(loop))
    assert [c.step for c in manager.checkpoints()] == [1]
    assert (tmp_path / "run" / "ckpt-000000001.ortcp").read_bytes() == before


class Refuses:
    """An object whose load_state_dict fails after the others were loaded."""

    def state_dict(self):
        return {"ok": 1}

    def load_state_dict(self, state):
        raise RuntimeError("refused by the user's object")


def test_a_failed_restore_leaves_every_object_as_it_was(tmp_path):
    loop = make_loop()
    train(loop, 0, 3)
    path = tmp_path / "a.ortcp"
    mine = Mine()
    save_objects({**state_of(loop), "mine": mine, "refuses": Refuses()}, path, step=3)

    other = make_loop(seed=4)
    other_mine = Mine()
    other_mine.value = {"mine": "before"}
    target = {**state_of(other), "mine": other_mine, "refuses": Refuses()}
    del target["rng"]
    before = _states(target)
    with pytest.raises(RuntimeError, match="refused by the user's object"):
        load_objects(target, path)  # "mine" (and the sampler, scheduler...) were loaded before it: undone
    assert_trees_equal(_states(target), before)

    wrong = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2))
    target = {"model": wrong, "mine": other_mine}
    before = _states(target)
    with pytest.raises(
        ValueError, match=r"state\['model'\].*unexpected keys \['3.bias', '3.weight'.*'0.weight': stored \(16, 6\)"
    ):
        load_objects(target, path)
    assert_trees_equal(_states(target), before)

    sgd = torch.optim.SGD(other.model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"state\['optimizer'\].*AdamW, the optimizer is a torch.optim.sgd.SGD"):
        load_objects({"mine": other_mine, "optimizer": sgd}, path)
    one_group = torch.optim.AdamW(other.model.parameters())
    with pytest.raises(ValueError, match=r"2 parameter group\(s\) of \[2, 4\] parameters.*1 of \[6\]"):
        load_objects({"optimizer": one_group}, path)
    with pytest.raises(KeyError, match=r"holds no object 'ema'; it holds \['mine', 'model'"):
        load_objects({"mine": other_mine, "ema": Mine()}, path)
    with pytest.raises(ValueError, match=r"state\['model'\] \(tests.*Mine, an object\).*holds a module \(torch.nn"):
        load_objects({"model": other_mine}, path)
    assert other_mine.value == {"mine": "before"}


def test_a_subset_of_the_objects_restores_alone(tmp_path):
    loop = make_loop()
    train(loop, 0, 2)
    save_objects(state_of(loop), tmp_path / "a.ortcp", step=2)
    model = make_loop(seed=3).model
    assert load_objects({"model": model}, tmp_path / "a.ortcp") == {}
    assert_trees_equal(model.state_dict(), loop.model.state_dict())


class _Mkdir:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_crafted_file_with_a_pickle_is_refused_without_running_it(tmp_path, caplog):
    marker = tmp_path / "pwned"
    loop = make_loop()
    save_objects({"model": loop.model, "mine": Mine()}, tmp_path / "good.ortcp", step=1)
    tree = checkpoint.load(tmp_path / "good.ortcp")
    tree[S.STATEFUL_KEY]["mine"] = {S.TAG_PICKLE: pickle.dumps(_Mkdir(str(marker)))}
    run = tmp_path / "run"
    run.mkdir()
    checkpoint.save(tree, run / "ckpt-000000001.ortcp")  # valid checksums: only the decoder can refuse it
    target = {"model": make_loop(seed=2).model, "mine": Mine()}
    before = _states(target)
    with pytest.raises(checkpoint.CheckpointPickleError, match=r"'stateful/mine' holds pickled data"):
        load_objects(target, run / "ckpt-000000001.ortcp")
    with caplog.at_level(logging.WARNING), pytest.raises(checkpoint.CheckpointCorruptError, match="pickled data"):
        CheckpointManager(run).restore(target)
    assert not marker.exists()
    assert_trees_equal(_states(target), before)


def test_a_trainer_checkpoint_is_not_taken_for_one_of_objects(tmp_path):
    checkpoint.save({"model": {"full_precision": {"w": torch.ones(2)}}}, tmp_path / "t.ortcp")
    with pytest.raises(ValueError, match=r"not a checkpoint of a dict of objects.*trainer.load_checkpoint"):
        load_objects({"model": torch.nn.Linear(2, 1)}, tmp_path / "t.ortcp")


def test_rng_state_restores_torch_python_and_numpy_generators():
    import random

    rng = RNGState()
    saved = copy.deepcopy(rng.state_dict())
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    rng.load_state_dict(saved)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    with pytest.raises(ValueError, match="not an RNGState state_dict"):
        rng.load_state_dict({"torch": saved["torch"]})


def test_a_run_directory_behind_an_fsspec_url_saves_prunes_and_restores(tmp_path):
    import uuid

    loop = make_loop()
    manager = CheckpointManager(f"memory://objects/{uuid.uuid4().hex}", keep_last=1, async_save=True)
    for step in (1, 2):
        train(loop, step - 1, step)
        manager.save(state_of(loop), step)
    manager.wait()
    assert [c.step for c in manager.checkpoints()] == [2]
    other = make_loop(seed=6)
    assert manager.restore(state_of(other)).step == 2
    assert_trees_equal(_states(state_of(other)), _states(state_of(loop)))


def test_a_trainer_refuses_a_checkpoint_of_objects_and_says_what_loads_it(tmp_path):
    from ort_trainer import ORTTrainer, optim
    from tests.models import MLP, MLP_DESC

    trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    before = {k: v.clone() for k, v in trainer.state_dict(pytorch_format=True).items()}
    save_objects({"model": MLP()}, tmp_path / "objects.ortcp")
    with pytest.raises(ValueError, match=r"objects.ortcp holds a dict of objects.*\['model'\].*load_objects"):
        trainer.load_checkpoint(tmp_path / "objects.ortcp")
    assert_trees_equal(trainer.state_dict(pytorch_format=True), before)
