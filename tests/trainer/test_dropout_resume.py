"""Resume is bit-exact with dropout on: step n's masks depend on (run seed, rank, n) only.

ONNX Runtime's Dropout draws from a process-wide generator that no checkpoint can hold; the trainer
reseeds it before every training run from ``train_step_info.seed`` (stored in checkpoints) and the
step counter. N steps == k steps + save + load (a new trainer, or a new process) + N - k steps.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from ort_trainer.engine._random import step_seed
from tests.dropout_worker import MODELS, SPLIT, STEPS, DropoutMLP, batches, make_trainer
from tests.paths import REPO

MLP_DESC = MODELS["mlp"][1]


def _run(trainer, name, start, stop):
    return [trainer.train_step(*b).item() for b in batches(name)[start:stop]]


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_a_new_trainer_resumes_bit_exact_with_dropout_on(tmp_path, name):
    full = make_trainer(name, 0)
    expected = _run(full, name, 0, STEPS)
    first = make_trainer(name, 0)
    losses = _run(first, name, 0, SPLIT)
    first.save_checkpoint(tmp_path / "ck.ortcp")
    resumed = make_trainer(name, 5)  # another torch seed: the run seed must come from the checkpoint
    resumed.load_checkpoint(tmp_path / "ck.ortcp")
    assert resumed.train_step_info.seed == full.train_step_info.seed
    losses += _run(resumed, name, SPLIT, STEPS)
    assert losses == expected
    _equal_states(resumed.state_dict(pytorch_format=True), full.state_dict(pytorch_format=True))


@pytest.mark.processes
def test_a_new_process_resumes_bit_exact_with_dropout_on(tmp_path):
    for phase in ("first", "resume"):
        cmd = [sys.executable, "-m", "tests.dropout_worker", phase, str(tmp_path)]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    for name in MODELS:
        full = checkpoint.load(tmp_path / f"{name}-full.h5")
        first = checkpoint.load(tmp_path / f"{name}-first.h5")
        resumed = checkpoint.load(tmp_path / f"{name}-resumed.h5")
        assert torch.cat([first.pop("losses"), resumed.pop("losses")]).tolist() == full.pop("losses").tolist()
        _equal_states(resumed, full)


def test_the_masks_differ_between_steps_and_runs_but_not_between_repeats():
    """Dropout is really on (the same batch twice gives two losses), and a run is a function of its seed."""
    x, y = batches("mlp")[0]

    def losses(torch_seed):
        trainer = make_trainer("mlp", torch_seed)
        return [trainer.train_step(x, y).item() for _ in range(3)], trainer.train_step_info.seed

    first, seed = losses(0)
    again, same_seed = losses(0)
    other, other_seed = losses(1)
    assert first == again and seed == same_seed
    assert len(set(first)) == 3  # lr 1e-3 moves the loss a little; the masks move it more
    assert seed != other_seed and first[0] != other[0]


def test_eval_step_stays_dropout_free():
    torch.manual_seed(0)
    model = DropoutMLP()
    trainer = ORTTrainer(model, MLP_DESC, optim.AdamConfig(lr=0.0), loss_fn=torch.nn.functional.cross_entropy)
    x, y = batches("mlp")[0]
    outs = [trainer.eval_step(x, y).item() for _ in range(3)]
    model.eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert outs == [outs[0]] * 3
    assert outs[0] == pytest.approx(expected, rel=1e-6)


def test_a_checkpoint_without_a_seed_keeps_the_trainers_own(tmp_path):
    """Files written before the seed was stored (and legacy ones): the trainer keeps its seed, which is
    ``torch.initial_seed()`` at construction, so a run rebuilt under the same ``torch.manual_seed`` resumes
    exactly, as documented."""
    full = make_trainer("mlp", 0)
    expected = _run(full, "mlp", 0, STEPS)
    first = make_trainer("mlp", 0)
    losses = _run(first, "mlp", 0, SPLIT)
    state = first.state_dict()
    del state["train_step_info"]["seed"]
    checkpoint.save(state, tmp_path / "old.ortcp")
    resumed = make_trainer("mlp", 0)
    resumed.train_step_info.seed = 12345  # not the run's: the file must not be able to change it
    resumed.load_checkpoint(tmp_path / "old.ortcp")
    assert resumed.train_step_info.seed == 12345
    resumed.train_step_info.seed = full.train_step_info.seed
    assert losses + _run(resumed, "mlp", SPLIT, STEPS) == expected


def test_the_seed_is_part_of_the_state_and_checked():
    trainer = make_trainer("mlp", 3)
    info = trainer.state_dict()["train_step_info"]
    assert info == {"optimization_step": 0, "step": 0, "seed": torch.initial_seed()}
    with pytest.raises(ValueError, match="'seed' must be an int >= 0"):
        trainer.load_state_dict({**trainer.state_dict(), "train_step_info": {**info, "seed": -1}})
    assert trainer.train_step_info.seed == torch.initial_seed()


def test_step_seeds_differ_per_step_and_rank_and_fit_int64():
    seeds = {step_seed(7, rank, step) for rank in range(4) for step in range(1, 1001)}
    assert len(seeds) == 4000 and all(0 <= s < 2**63 for s in seeds)
    assert step_seed(7, 0, 5) == step_seed(7, 0, 5) != step_seed(8, 0, 5)
