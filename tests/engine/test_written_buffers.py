"""Buffers written by the user between steps, or by the forward itself, reach the graph as in eager PyTorch.

Integer buffers (a step counter) and non-persistent float buffers (a temperature) are not float state of the
``state_dict``; they must still be read by every step as they are now (not as they were at the first build), and
``state_dict`` must report what was written. Each test runs the same writes on a deep copy in eager PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTModule, ORTTrainer, optim
from tests.buffer_models import AUTOGRAD, DESC, Counting, Tempered, ce
from tests.buffer_models import batches as _batches


def _write(module: torch.nn.Module, step: int) -> None:
    """What a user's loop does between steps: a new temperature, the counter advanced in place."""
    module.temperature.fill_(2.0 + step)
    module.step_count += 1


def test_trainer_reads_buffers_written_between_steps_like_torch():
    torch.manual_seed(0)
    model = Tempered()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=AUTOGRAD)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, (x, label) in enumerate(_batches(3)):
        loss = trainer.train_step(x, label)
        opt.zero_grad()
        expected = ce(reference(x), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6, msg=f"step {step}")
        _write(model, step)
        _write(reference, step)
    x, label = _batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(x, label), ce(reference(x), label), atol=1e-6, rtol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    assert state.keys() == reference.state_dict().keys()
    assert int(state["step_count"]) == 3
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-6, msg=name)


def test_trainer_follows_a_buffer_its_forward_writes_like_torch():
    torch.manual_seed(1)
    model = Counting()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=AUTOGRAD)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, (x, label) in enumerate(_batches(3)):
        loss = trainer.train_step(x, label)
        opt.zero_grad()
        expected = ce(reference(x), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6, msg=f"step {step}")
    assert int(trainer.state_dict(pytorch_format=True)["calls"]) == int(reference.calls) == 3
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)[name], value, atol=1e-6, rtol=1e-6)


def test_ortmodule_reads_buffers_written_between_steps_like_torch():
    torch.manual_seed(2)
    model = Tempered()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, (x, label) in enumerate(_batches(3)):
        opt.zero_grad()
        loss = ce(wrapped(x), label)
        loss.backward()
        opt.step()
        opt_ref.zero_grad()
        expected = ce(reference(x), label)
        expected.backward()
        opt_ref.step()
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-6, rtol=1e-6, msg=f"step {step}")
        _write(model, step)
        _write(reference, step)
    state = wrapped.state_dict()
    assert int(state["step_count"]) == 3
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-6, msg=name)


def test_trainer_loads_integer_buffers_of_a_pytorch_state_dict():
    torch.manual_seed(3)
    model = Tempered()
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=AUTOGRAD)
    reference = Tempered()
    reference.step_count.fill_(7)
    trainer.load_state_dict(reference.state_dict())
    assert int(trainer.state_dict(pytorch_format=True)["step_count"]) == 7
    x, label = _batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(trainer.train_step(x, label), ce(reference(x), label), atol=1e-6, rtol=1e-6)


def test_trainer_eval_step_keeps_a_buffer_its_forward_writes_like_torch():
    torch.manual_seed(4)
    model = Counting()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=AUTOGRAD)
    for x, label in _batches(2):
        with torch.no_grad():
            torch.testing.assert_close(trainer.eval_step(x, label), ce(reference(x), label), atol=1e-6, rtol=1e-6)
    assert int(trainer.state_dict(pytorch_format=True)["calls"]) == int(reference.calls) == 2


def test_trainer_refuses_a_buffer_assigned_anew():
    """``model.step_count = tensor`` (not in place) leaves the trainer's buffer behind: refused, not ignored."""
    torch.manual_seed(5)
    model = Tempered()
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=AUTOGRAD)
    x, label = _batches(1)[0]
    trainer.train_step(x, label)
    model.step_count = torch.tensor(4)
    with pytest.raises(ValueError, match=r"step_count.*no longer a view of this trainer's buffer"):
        trainer.train_step(x, label)
