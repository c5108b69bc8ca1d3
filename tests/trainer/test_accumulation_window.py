"""Checkpoints and gradient accumulation windows (issue 32, item 4).

The gradient accumulated within a window is not part of a checkpoint, and the buffer is reset only at a
window's first micro-step. Before the fix, a save after micro-step k (k not a multiple of
``gradient_accumulation_steps``) succeeded and its resume silently changed the next update (0.016 max
weight difference after one update on this MLP with GA = 2). Now such a save is refused with an error
naming the step, the window and the path; the run can save at the next boundary, where resume is
bit-exact. A mid-window state that still reaches ``load_checkpoint`` (a weights-only save, a file from an
older version) is loaded with a warning, and the next update uses only the micro-steps after it, the
same whatever the trainer held before.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ort_trainer import checkpoint
from tests.builders import mlp_trainer
from tests.models import mlp_batches

GA = 2


def _trainer(seed: int = 0):
    return mlp_trainer(seed=seed, batch={"gradient_accumulation_steps": GA})


def _train(trainer, batches, start: int, stop: int) -> list[float]:
    return [trainer.train_step(*b).item() for b in batches[start:stop]]


def _assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(pytorch_format=True), b.state_dict(pytorch_format=True)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_inside_an_accumulation_window_is_refused_and_keeps_the_previous_checkpoint(tmp_path, async_save):
    batches = mlp_batches(8)
    trainer = _trainer()
    _train(trainer, batches, 0, 2)
    path = tmp_path / "ck.ortcp"
    trainer.save_checkpoint(path, async_save=async_save).wait()
    good = path.read_bytes()
    _train(trainer, batches, 2, 3)  # step 3: one micro-step of the window 3..4 accumulated
    with pytest.raises(ValueError) as caught:
        trainer.save_checkpoint(path, overwrite=True, async_save=async_save)
    message = str(caught.value)
    for part in ("step 3", "gradient_accumulation_steps=2", "step 4", str(path)):
        assert part in message, f"{part!r} not in: {message}"
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.ortcp"]  # no temporary file left
    with pytest.raises(ValueError, match="step 3"):
        trainer.save_checkpoint(tmp_path / "other.ortcp", async_save=async_save)
    assert not (tmp_path / "other.ortcp").exists()
    _train(trainer, batches, 3, 4)  # the window's update ran: the state is complete again
    trainer.save_checkpoint(path, overwrite=True, async_save=async_save).wait()
    assert checkpoint.load(path)["train_step_info"]["step"] == 4


def test_a_run_that_saves_at_the_window_boundary_resumes_bit_exact(tmp_path):
    batches = mlp_batches(9)
    full = _trainer()
    expected = _train(full, batches, 0, 9)  # ends inside a window: step 9 of the window 9..10
    first = _trainer()
    losses = _train(first, batches, 0, 3)
    with pytest.raises(ValueError):
        first.save_checkpoint(tmp_path / "ck.ortcp")
    losses += _train(first, batches, 3, 4)
    first.save_checkpoint(tmp_path / "ck.ortcp")
    resumed = _trainer(seed=5)
    resumed.load_checkpoint(tmp_path / "ck.ortcp")
    losses += _train(resumed, batches, 4, 9)
    assert losses == expected
    _assert_same_weights(resumed, full)
    resumed.train_step(*batches[0])  # step 10 completes the window: the update uses steps 9 and 10
    full.train_step(*batches[0])
    _assert_same_weights(resumed, full)


def test_the_checkpoint_manager_refuses_the_save_and_records_nothing(tmp_path, caplog):
    batches = mlp_batches(4)
    trainer = _trainer()
    manager = checkpoint.CheckpointManager(tmp_path / "run", keep_last=2)
    _train(trainer, batches, 0, 2)
    manager.save(trainer)
    _train(trainer, batches, 2, 3)
    with pytest.raises(ValueError, match="step 3"):
        manager.save(trainer)
    assert [info.step for info in manager.checkpoints()] == [2]
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    restored = manager.restore(_trainer())
    assert restored.step == 2
    assert not [r for r in caplog.records if "did not complete" in r.getMessage()]  # no phantom step 3


def test_a_weights_only_save_inside_a_window_is_allowed(tmp_path):
    """Without the optimizer state a file is no exact-resume checkpoint anyway: the weights of a run
    that ends inside a window can still be saved."""
    trainer = _trainer()
    _train(trainer, mlp_batches(3), 0, 3)
    trainer.save_checkpoint(tmp_path / "weights.ortcp", include_optimizer_states=False)
    saved = checkpoint.load(tmp_path / "weights.ortcp")
    assert "optimizer" not in saved and saved["train_step_info"]["step"] == 3


def test_a_mid_window_state_loads_with_a_warning_and_the_next_update_ignores_stale_gradients(tmp_path, caplog):
    """A file saved inside a window (by an older version, or ``checkpoint.save(trainer.state_dict())``)
    loaded into a fresh trainer or into one whose gradient buffer holds other gradients: the same run."""
    batches = mlp_batches(6)
    first = _trainer()
    _train(first, batches, 0, 3)
    path = tmp_path / "mid-window.ortcp"
    checkpoint.save(first.state_dict(), path)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    fresh = _trainer()
    fresh.load_checkpoint(path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in m and "gradient_accumulation_steps=2" in m for m in warnings), warnings
    used = _trainer()
    _train(used, mlp_batches(3, seed=9), 0, 3)  # its buffer holds half a window of other gradients
    used.load_checkpoint(path)
    _train(fresh, batches, 3, 6)
    _train(used, batches, 3, 6)
    _assert_same_weights(fresh, used)
