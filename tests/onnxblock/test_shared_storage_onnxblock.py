"""Shared-memory storage on the onnxblock engine (issue S5, task 2; the autograd engine's side is
tests/engine/test_bound_storage.py, issue S point 2): a module whose storages are in shared memory before the
trainer is built (``model.share_memory()``), a module moved to shared memory after the first step, and a module
received in a spawned process through a ``torch.multiprocessing`` queue, each trained on the onnxblock engine,
equal to eager PyTorch and to the autograd engine. Every test here is marked ``onnxblock`` (tests/conftest.py):
it needs onnxruntime-training."""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.models import CNN, CNN_DESC, cnn_batches
from tests.onnxblock.shared_storage_worker import train_received_module

ce = torch.nn.functional.cross_entropy


def _trainer(model: torch.nn.Module, engine: str) -> ORTTrainer:
    return ORTTrainer(model, CNN_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options={"utils": {"engine": engine}})


def _eager(reference: torch.nn.Module, batches) -> tuple[list[float], float]:
    """Eager PyTorch's SGD losses over ``batches`` and its eval loss on the first batch."""
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for inputs, label in batches:
        opt.zero_grad()
        loss = ce(reference(inputs), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    reference.eval()
    with torch.no_grad():
        evaluated = ce(reference(cnn_batches(1)[0][0]), cnn_batches(1)[0][1]).item()
    return losses, evaluated


def _assert_states_close(got: dict, expected: dict) -> None:
    """The float entries (BatchNorm's ``num_batches_tracked`` is not counted by the trainer, on either engine)."""
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("when", ["before-the-trainer", "after-the-first-step"])
def test_shared_memory_module_trains_on_onnxblock_like_torch_and_the_autograd_engine(when):
    torch.manual_seed(0)
    model = CNN()  # BatchNorm: shared float buffers and an int64 counter too
    reference, other = copy.deepcopy(model), copy.deepcopy(model)
    batches = cnn_batches(4)
    if when == "before-the-trainer":
        model.share_memory()
        other.share_memory()
    shared_before = [model.conv.weight.detach(), other.conv.weight.detach()]
    trainers = {"onnxblock": _trainer(model, "onnxblock"), "autograd": _trainer(other, "autograd")}
    losses = {engine: [float(t.train_step(*batches[0]))] for engine, t in trainers.items()}
    if when == "before-the-trainer":
        # the trainer moved the parameters into its own (private) flat buffers, on both engines: the shared
        # storage another process may hold keeps the initial weights (no Hogwild through a trainer)
        assert not model.conv.weight.is_shared() and not other.conv.weight.is_shared()
        for tensor in shared_before:
            assert tensor.is_shared()
            torch.testing.assert_close(tensor, reference.conv.weight.detach(), rtol=0, atol=0)
    else:
        model.share_memory()  # the flat buffers themselves move to shared memory: the trainer rebinds
        other.share_memory()
        assert model.conv.weight.is_shared() and other.conv.weight.is_shared()
    for engine, trainer in trainers.items():
        losses[engine] += [float(trainer.train_step(*batch)) for batch in batches[1:]]
    assert trainers["onnxblock"].engine == "onnxblock" and trainers["autograd"].engine == "autograd"
    expected, expected_eval = _eager(reference, batches)
    for engine, trainer in trainers.items():
        torch.testing.assert_close(losses[engine], expected, atol=1e-5, rtol=1e-5, msg=engine)
        evaluated = float(trainer.eval_step(*cnn_batches(1)[0]))
        torch.testing.assert_close(evaluated, expected_eval, atol=1e-5, rtol=1e-5, msg=engine)
    _assert_states_close(model.state_dict(), reference.state_dict())  # the module shows the trained state
    _assert_states_close(other.state_dict(), reference.state_dict())


@pytest.mark.processes
def test_a_module_received_through_a_spawn_queue_trains_on_onnxblock_like_torch():
    torch.manual_seed(1)
    model = CNN()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    context = torch.multiprocessing.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    worker = context.Process(target=train_received_module, args=(inbox, outbox))
    worker.start()
    try:
        inbox.put((model, "onnxblock"))  # pickled for the queue: the storages move to shared memory
        got = outbox.get(timeout=120)
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert worker.exitcode == 0
    assert got["shared"] and got["engine"] == "onnxblock"
    expected, expected_eval = _eager(reference, cnn_batches(3))
    torch.testing.assert_close(got["losses"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["eval"], expected_eval, atol=1e-5, rtol=1e-5)
    state = {name: torch.from_numpy(value) for name, value in got["state"].items()}
    _assert_states_close(state, reference.state_dict())
    # the worker's trainer trained its own buffers: the parent's module, whose storages the queue moved to shared
    # memory, keeps its initial weights
    assert model.conv.weight.is_shared()
    _assert_states_close(model.state_dict(), initial)
