"""The model's integer buffers (a step counter, a count the forward keeps, BatchNorm's ``num_batches_tracked``) are
part of the trainer's own state dict and of its checkpoints: a run resumed from a checkpoint trains on as if it
had never stopped. Non-persistent buffers (a temperature) are not saved, as in ``torch.nn.Module.state_dict``."""

from __future__ import annotations

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.checkpoint.format import schema as S
from tests.buffer_models import AUTOGRAD, DESC, Counting, Tempered, ce
from tests.buffer_models import batches as _batches
from tests.models import CNN, CNN_DESC, cnn_batches

BUFFERS = S.BUFFERS_KEY  # model/buffers/<name>


def _trainer(model: torch.nn.Module) -> ORTTrainer:
    return ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=lambda o, y: ce(o, y), options=AUTOGRAD)


def _between_steps(model: torch.nn.Module, step: int) -> None:
    """A user's loop: Tempered's temperature follows the step (set again on resume), its counter advances."""
    if isinstance(model, Tempered):
        model.temperature.fill_(2.0 + step)
        model.step_count += 1


def _run(trainer: ORTTrainer, model: torch.nn.Module, steps: range) -> list[torch.Tensor]:
    batches = _batches(steps.stop)
    losses = []
    for step in steps:
        losses.append(trainer.train_step(*batches[step]).detach().clone())
        _between_steps(model, step)
    return losses


def _buffer_name(model: torch.nn.Module) -> str:
    return "step_count" if isinstance(model, Tempered) else "calls"


@pytest.mark.parametrize("cls", [Tempered, Counting], ids=["written-between-steps", "written-by-the-forward"])
def test_a_resumed_run_keeps_the_integer_buffers_and_trains_as_an_uninterrupted_one(cls, tmp_path):
    torch.manual_seed(0)
    first = cls()
    second = cls()
    second.load_state_dict(first.state_dict())
    reference = cls()
    reference.load_state_dict(first.state_dict())
    name = _buffer_name(first)

    straight = _trainer(reference)
    expected = _run(straight, reference, range(5))

    trainer = _trainer(first)
    losses = _run(trainer, first, range(3))
    path = tmp_path / "ckpt.h5"
    trainer.save_checkpoint(path)
    assert int(getattr(first, name)) == 3

    resumed = _trainer(second)
    resumed.load_checkpoint(path)
    assert int(resumed.state_dict(pytorch_format=True)[name]) == 3
    assert int(getattr(second, name)) == 3  # the module shows the trainer's buffer
    if isinstance(second, Tempered):
        second.temperature.fill_(2.0 + 2)  # non-persistent: the user's loop sets it again, as torch would need
    losses += _run(resumed, second, range(3, 5))

    for step, (loss, want) in enumerate(zip(losses, expected, strict=True)):
        torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6, msg=f"step {step}")
    got, want = resumed.state_dict(pytorch_format=True), straight.state_dict(pytorch_format=True)
    assert got.keys() == want.keys()
    assert int(got[name]) == int(want[name]) == 5
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6, msg=key)


@pytest.mark.parametrize("cls", [Tempered, Counting], ids=["written-between-steps", "written-by-the-forward"])
def test_own_format_state_dict_round_trip_carries_the_integer_buffers(cls):
    torch.manual_seed(1)
    model = cls()
    trainer = _trainer(model)
    _run(trainer, model, range(3))
    name = _buffer_name(model)
    state = trainer.state_dict()
    assert set(state[S.MODEL_KEY][BUFFERS]) == {name}  # the non-persistent temperature is not state
    assert state[S.MODEL_KEY][BUFFERS][name].dtype == torch.int64
    assert int(state[S.MODEL_KEY][BUFFERS][name]) == 3
    state[S.MODEL_KEY][BUFFERS][name] += 1  # a copy: the trainer is not affected
    assert int(getattr(model, name)) == 3

    fresh = cls()
    other = _trainer(fresh)
    result = other.load_state_dict(state, strict=True)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert int(other.state_dict(pytorch_format=True)[name]) == 4
    assert int(getattr(fresh, name)) == 4


def test_a_buffer_of_the_wrong_shape_or_dtype_is_refused_and_the_trainer_is_left_as_it_was(tmp_path):
    torch.manual_seed(2)
    model = Counting()
    trainer = _trainer(model)
    _run(trainer, model, range(3))
    before = trainer.state_dict()

    other_model = Counting()
    other = _trainer(other_model)
    _run(other, other_model, range(1))
    kept = other.state_dict()

    def unchanged() -> None:
        now = other.state_dict()
        assert int(now[S.MODEL_KEY][BUFFERS]["calls"]) == 1 == int(other_model.calls)
        for key, value in kept[S.MODEL_KEY][S.FULL_PRECISION_KEY].items():
            assert torch.equal(now[S.MODEL_KEY][S.FULL_PRECISION_KEY][key], value), key

    for bad in (torch.zeros(2, dtype=torch.int64), torch.tensor(3.0)):
        state = trainer.state_dict()
        state[S.MODEL_KEY][BUFFERS]["calls"] = bad
        with pytest.raises(ValueError, match=r"calls"):
            other.load_state_dict(state, strict=True)
        unchanged()
        path = tmp_path / f"bad-{bad.dtype}-{bad.dim()}.h5"
        trainer.save_checkpoint(path)
        _rewrite_buffer(path, "calls", bad)
        with pytest.raises(ValueError, match=r"calls"):
            other.load_checkpoint(path)
        unchanged()
    # the good state still loads afterwards
    other.load_state_dict(before)
    assert int(other_model.calls) == 3


def _rewrite_buffer(path, name: str, value: torch.Tensor) -> None:
    """The file again, with one buffer replaced (a checkpoint from another model)."""
    from ort_trainer import checkpoint

    with checkpoint.open_checkpoint(path) as reader:
        tree = reader.read()
    tree[S.MODEL_KEY][BUFFERS][name] = value
    checkpoint.save(tree, path, overwrite=True)


def test_a_state_without_the_buffers_group_loads_as_before_and_keeps_the_buffers(tmp_path):
    """Checkpoints written before the group existed: the buffers keep the values they have, no error."""
    torch.manual_seed(3)
    model = Counting()
    trainer = _trainer(model)
    _run(trainer, model, range(3))
    state = trainer.state_dict()
    del state[S.MODEL_KEY][BUFFERS]
    path = tmp_path / "old.h5"
    trainer.save_checkpoint(path)
    _drop_buffers(path)

    fresh = Counting()
    other = _trainer(fresh)
    _run(other, fresh, range(2))
    other.load_state_dict(state, strict=True)
    assert int(fresh.calls) == 2
    other.load_checkpoint(path, strict=True)
    assert int(fresh.calls) == 2
    for key, value in state[S.MODEL_KEY][S.FULL_PRECISION_KEY].items():
        torch.testing.assert_close(other.state_dict()[S.MODEL_KEY][S.FULL_PRECISION_KEY][key], value)


def _drop_buffers(path) -> None:
    from ort_trainer import checkpoint

    with checkpoint.open_checkpoint(path) as reader:
        tree = reader.read()
    del tree[S.MODEL_KEY][BUFFERS]
    checkpoint.save(tree, path, overwrite=True)


def test_batchnorm_num_batches_tracked_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(4)
    model = CNN()
    trainer = ORTTrainer(model, CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    for batch in cnn_batches(3):
        trainer.train_step(*batch)
    assert int(trainer.state_dict(pytorch_format=True)["bn.num_batches_tracked"]) == 3
    path = tmp_path / "cnn.h5"
    trainer.save_checkpoint(path)

    for steps_first in (0, 1):  # loaded before the first step (no engine yet) and after it
        torch.manual_seed(5)
        fresh = CNN()
        other = ORTTrainer(fresh, CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
        for batch in cnn_batches(steps_first, seed=9):
            other.train_step(*batch)
        other.load_checkpoint(path)
        assert int(other.state_dict(pytorch_format=True)["bn.num_batches_tracked"]) == 3
        assert int(other.state_dict()[S.MODEL_KEY][BUFFERS]["bn.num_batches_tracked"]) == 3
        other.train_step(*cnn_batches(1, seed=7)[0])
        assert int(other.state_dict(pytorch_format=True)["bn.num_batches_tracked"]) == 4


def test_aggregating_a_rank_set_keeps_the_buffers(tmp_path):
    from ort_trainer import checkpoint as C
    from tests.rank_states import FLAT, full_state, save_ranks

    full = full_state("AdamOptimizer")
    full[S.MODEL_KEY][BUFFERS] = {"calls": torch.tensor(3), "bn.num_batches_tracked": torch.tensor(5)}
    states = C.reshard_state(full, 2, zero_stage=1, flat_order=FLAT, run_id="run-1")
    aggregated = C.aggregate_checkpoints(save_ranks(states, tmp_path))
    assert set(aggregated[S.MODEL_KEY][BUFFERS]) == {"calls", "bn.num_batches_tracked"}
    assert int(aggregated[S.MODEL_KEY][BUFFERS]["calls"]) == 3
    assert int(aggregated[S.MODEL_KEY][BUFFERS]["bn.num_batches_tracked"]) == 5


def test_convert_carries_the_buffers_to_and_from_a_pytorch_state_dict(tmp_path):
    from ort_trainer.checkpoint.cli._convert import run_convert

    torch.manual_seed(6)
    model = CNN()
    trainer = ORTTrainer(model, CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    for batch in cnn_batches(3):
        trainer.train_step(*batch)
    trainer.save_checkpoint(tmp_path / "cnn.ortcp")
    run_convert(
        tmp_path / "cnn.ortcp",
        tmp_path / "cnn.pt",
        "checkpoint",
        optimizer=False,
        prefix=None,
        optimizer_name="AdamOptimizer",
        overwrite=False,
    )
    fresh = CNN()
    fresh.load_state_dict(torch.load(tmp_path / "cnn.pt", weights_only=True), strict=True)  # a module's full state
    assert int(fresh.bn.num_batches_tracked) == 3
    expected = trainer.state_dict(pytorch_format=True)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=name)

    run_convert(
        tmp_path / "cnn.pt",
        tmp_path / "back.ortcp",
        "torch",
        optimizer=False,
        prefix=None,
        optimizer_name="AdamOptimizer",
        overwrite=False,
    )
    other = ORTTrainer(CNN(), CNN_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce)
    other.load_checkpoint(tmp_path / "back.ortcp", strict=True)
    got = other.state_dict(pytorch_format=True)
    assert int(got["bn.num_batches_tracked"]) == 3
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)
