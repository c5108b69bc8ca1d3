"""Checkpoints for PyTorch habits: per-rank user_dicts survive aggregation, Stateful objects ride along,
user_dict takes int-keyed dicts and numpy Generator states."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ort_trainer import checkpoint
from tests.builders import mlp_trainer
from tests.models import MLP, mlp_batches
from tests.rank_states import full_state, save_ranks
from tests.trees import assert_trees_equal

ce = torch.nn.functional.cross_entropy


# ---------------------------------------------------------------------------- per-rank user_dict (point 4)
def _folder(path):
    path.mkdir()
    return path


def test_aggregation_keeps_every_ranks_user_dict(tmp_path):
    states = checkpoint.reshard_state(full_state(), 3, zero_stage=1)
    for rank, state in enumerate(states):
        state["user_dict"] = checkpoint.encode_user_dict({"rank": rank, "sampler": {"offset": 10 * rank}})
    for out in (
        checkpoint.aggregate_states(states),
        checkpoint.aggregate_checkpoints(save_ranks(states, tmp_path)),
        checkpoint.load(
            checkpoint.aggregate_to_file(save_ranks(states, _folder(tmp_path / "b")), tmp_path / "f.ortcp")
        ),
    ):
        assert checkpoint.decode_user_dict(out["user_dict"]) == {"rank": 0, "sampler": {"offset": 0}}
        ranks = out["rank_user_dicts"]
        assert sorted(ranks) == ["0", "1", "2"]
        for rank in range(3):
            assert checkpoint.decode_user_dict(ranks[str(rank)]) == {"rank": rank, "sampler": {"offset": 10 * rank}}


def test_aggregation_without_user_dicts_adds_nothing():
    states = checkpoint.reshard_state(full_state(), 2, zero_stage=1)
    for state in states:
        state.pop("user_dict")
    out = checkpoint.aggregate_states(states)
    assert "user_dict" not in out and "rank_user_dicts" not in out


# ---------------------------------------------------------------------------- user_dict values
def test_user_dict_takes_int_keyed_dicts_big_ints_and_generator_states(tmp_path):
    rng = np.random.default_rng(1234)
    rng.random(5)
    value = {
        "per_epoch_loss": {0: 1.5, 1: 1.25, 10: 0.5},
        "mixed": {1: "a", "b": 2},
        "numpy_rng": rng.bit_generator.state,  # PCG64: 128-bit ints
        "python_rng": random.Random(3).getstate(),
        "torch_rng": torch.Generator().manual_seed(5).get_state(),
        "huge": -(2**100),
    }
    path = tmp_path / "u.ortcp"
    checkpoint.save({"user_dict": checkpoint.encode_user_dict(value)}, path)
    back = checkpoint.decode_user_dict(checkpoint.load(path)["user_dict"])
    assert back["per_epoch_loss"] == value["per_epoch_loss"] and back["mixed"] == value["mixed"]
    assert back["numpy_rng"] == value["numpy_rng"] and back["huge"] == value["huge"]
    assert back["python_rng"] == value["python_rng"]
    restored = np.random.default_rng()
    restored.bit_generator.state = back["numpy_rng"]
    assert restored.random() == rng.random()
    with pytest.raises(TypeError, match=r"user_dict keys must be str or int, got \[\(1, 2\)\] at 'user_dict/bad'"):
        checkpoint.encode_user_dict({"bad": {(1, 2): 3}})


# ---------------------------------------------------------------------------- Stateful objects in checkpoints
class Sampler:
    def __init__(self, offset=0):
        self.offset, self.epoch = offset, 0

    def state_dict(self):
        return {"offset": self.offset, "epoch": self.epoch, "order": torch.arange(4)}

    def load_state_dict(self, state):
        self.offset, self.epoch = state["offset"], state["epoch"]


class EMA:
    def __init__(self, model):
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state_dict(self):
        return {"shadow": self.shadow, "decay": 0.99}

    def load_state_dict(self, state):
        if set(state["shadow"]) != set(self.shadow):
            raise KeyError(f"EMA: keys differ: {sorted(set(state['shadow']) ^ set(self.shadow))}")
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


class Metrics:
    def __init__(self):
        self.history = {}

    def state_dict(self):
        return {"history": dict(self.history)}

    def load_state_dict(self, state):
        self.history = dict(state["history"])


def test_stateful_objects_are_saved_and_loaded_without_pickle(tmp_path):
    trainer = mlp_trainer()
    sampler, ema, metrics = Sampler(offset=128), EMA(MLP()), Metrics()
    for step, batch in enumerate(mlp_batches(3)):
        metrics.history[step] = trainer.train_step(*batch).item()
    sampler.epoch = 2
    path = tmp_path / "s.ortcp"
    trainer.save_checkpoint(path, stateful={"sampler": sampler, "ema": ema, "metrics": metrics})
    assert "stateful" in checkpoint.load(path)  # stored as plain groups (no pickle needed to read it back)
    fresh, fresh_sampler, fresh_ema, fresh_metrics = mlp_trainer(seed=1), Sampler(), EMA(MLP()), Metrics()
    fresh.load_checkpoint(path, stateful={"sampler": fresh_sampler, "ema": fresh_ema, "metrics": fresh_metrics})
    assert (fresh_sampler.offset, fresh_sampler.epoch) == (128, 2)
    assert_trees_equal(fresh_ema.shadow, ema.shadow)
    assert fresh_metrics.history == metrics.history
    assert_trees_equal(fresh.state_dict(), trainer.state_dict())


def test_a_failing_component_leaves_everything_unchanged(tmp_path):
    trainer = mlp_trainer()
    trainer.train_step(*mlp_batches(1)[0])
    path = tmp_path / "s.ortcp"
    trainer.save_checkpoint(path, stateful={"sampler": Sampler(offset=7), "ema": EMA(MLP())})
    fresh = mlp_trainer(seed=1)
    fresh.train_step(*mlp_batches(1)[0])
    before = fresh.state_dict()
    sampler = Sampler(offset=3)
    wrong_ema = EMA(torch.nn.Linear(2, 2))  # its load_state_dict raises
    with pytest.raises(KeyError, match="EMA: keys differ"):
        fresh.load_checkpoint(path, stateful={"sampler": sampler, "ema": wrong_ema})
    assert sampler.offset == 3  # rolled back
    assert_trees_equal(fresh.state_dict(), before)
    with pytest.raises(KeyError, match=r"stateful\['metrics'\] is not in .*s.ortcp.*stored: \['ema', 'sampler'\]"):
        fresh.load_checkpoint(path, stateful={"metrics": Metrics()})
    assert_trees_equal(fresh.state_dict(), before)
    with pytest.raises(TypeError, match=r"stateful\['x'\] must have state_dict\(\) and load_state_dict\(\)"):
        trainer.save_checkpoint(tmp_path / "t.ortcp", stateful={"x": object()})
    assert not (tmp_path / "t.ortcp").exists()
