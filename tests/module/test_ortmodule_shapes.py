"""`ORTModule` at varying input shapes: one graph with symbolic sizes serves them, equal to eager PyTorch.

Dynamo makes a dim symbolic when it is marked (``torch._dynamo.mark_dynamic``) or once its size has changed; the
graph is then exported with symbolic dims and runs every later size in one ONNX Runtime session (forward and
backward), its random draws sized per call. What the exporter cannot export with symbolic dims falls back to
graphs per shape, said once. Builds are counted from the ``ORT <kind> graph`` log lines.

Dynamo remembers per code object which dims changed (a fresh instance of a class starts with them symbolic), so
each test that counts builds has a module class of its own.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ort_trainer import ORTModule
from ort_trainer.graph.autograd import SymbolicShapesError
from tests.models import TinyLM, lm_batches, lm_loss, mlp_batches


def _builds(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ORT ")]


def _kinds(caplog) -> list[str]:
    return [message.split(":")[0] for message in _builds(caplog)]


def _train(module, batches, loss_fn, seed=0) -> list[float]:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for inputs, label in batches:
        opt.zero_grad()
        loss = loss_fn(module(inputs), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_state_equal(model, reference, atol=1e-5, rtol=1e-4):
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        if name.endswith("in_proj_bias"):  # the key bias: softmax ignores it, its gradient is rounding noise
            p, q = torch.cat([p[:16], p[32:]]), torch.cat([q[:16], q[32:]])  # that Adam scales up to +-lr
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def test_a_transformer_with_dropout_at_varying_batch_and_sequence_builds_one_forward_and_one_backward(caplog):
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1)
    reference = copy.deepcopy(model)
    shapes = [(4, 8), (3, 5), (2, 11), (4, 6), (3, 7)]
    batches = [lm_batches(1, batch=b, seq=s, seed=i)[0] for i, (b, s) in enumerate(shapes)]
    torch._dynamo.mark_dynamic(batches[0][0], 0)  # batch and sequence symbolic from the first call
    torch._dynamo.mark_dynamic(batches[0][0], 1)
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _train(ORTModule(model), batches, lm_loss)
    after = torch.rand(3)  # torch's generator is where eager leaves it: the masks were eager's, at every shape
    expected = _train(reference, batches, lm_loss)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert torch.equal(after, torch.rand(3))
    _assert_state_equal(model, reference)
    assert _kinds(caplog) == ["ORT forward graph", "ORT backward graph"]
    assert all("symbolic sizes" in message for message in _builds(caplog))


def test_dynamic_true_gives_one_graph_from_the_first_call_for_every_length_and_the_last_smaller_batch(caplog):
    """Dynamo alone makes a dim symbolic only once that dim has changed: lengths that vary under a constant batch,
    then an epoch's smaller last batch, build three graphs (the third cost 25 s at GPT-2 small in
    benchmarks/varlen.py). ``ORTModule(model, dynamic=True)``, as ``torch.compile``'s, builds one."""
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    shapes = [(4, 8), (4, 5), (4, 11), (4, 6), (3, 7), (2, 9)]  # the batch changes only at the end
    batches = [lm_batches(1, batch=b, seq=s, seed=i)[0] for i, (b, s) in enumerate(shapes)]
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _train(ORTModule(model, dynamic=True), batches, lm_loss)
    expected = _train(reference, batches, lm_loss)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_state_equal(model, reference)
    assert _kinds(caplog) == ["ORT forward graph", "ORT backward graph"]
    assert all("symbolic sizes" in message for message in _builds(caplog))
    with pytest.raises(TypeError, match=r"dynamic must be None, True or False .*got 'yes'"):
        ORTModule(model, dynamic="yes")


class _Vision(torch.nn.Module):
    """Conv, BatchNorm, max-pool, a strided conv and a global average (an image size of 10 or more: the strided
    conv then yields 2 x 2 or more; a size of 1 would be its own graph, as every tracer specialises it)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 6, 3, stride=2)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv1(x))), 2)
        x = torch.relu(self.conv2(x))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def test_a_cnn_fed_two_image_sizes_then_others_runs_them_on_one_symbolic_graph(caplog):
    torch.manual_seed(0)
    model = _Vision()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    # 12 gets its own graph, 16 makes height and width symbolic, 13, 17 and 11 run on it too (odd and even sizes:
    # the stride-2 conv's backward cuts its results by gathers, not views whose contiguity the trace would guard)
    sizes = [12, 16, 12, 13, 17, 11]
    batches = [(torch.randn(4, 3, s, s, generator=g), torch.randint(0, 3, (4,), generator=g)) for s in sizes]
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _train(ORTModule(model), batches, torch.nn.functional.cross_entropy)
    expected = _train(reference, batches, torch.nn.functional.cross_entropy)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    _assert_state_equal(model, reference)  # BatchNorm's running statistics included
    assert _kinds(caplog) == ["ORT forward graph", "ORT backward graph"] * 2
    assert all("symbolic sizes" in message for message in _builds(caplog)[2:])


class _Tail(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_last_partial_batch_gets_one_symbolic_graph_that_serves_later_epochs_and_eval(caplog):
    torch.manual_seed(0)
    model = _Tail()
    reference = copy.deepcopy(model)
    data = mlp_batches(4)
    data[-1] = (data[-1][0][:5], data[-1][1][:5])  # 8, 8, 8 and a last batch of 5
    wrapped = ORTModule(model)
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _train(wrapped, data * 2, torch.nn.functional.cross_entropy)
        training = _builds(caplog)
        wrapped.eval()
        with torch.no_grad():
            outputs = [wrapped(x) for x, _ in data]
    expected = _train(reference, data * 2, torch.nn.functional.cross_entropy)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-6, rtol=1e-5)
    _assert_state_equal(model, reference, atol=1e-6, rtol=1e-5)
    assert _kinds(caplog)[: len(training)] == ["ORT forward graph", "ORT backward graph"] * 2  # 8's, then 5's
    assert "symbolic" not in training[0] and "symbolic sizes" in training[2]
    reference.eval()
    for out, (x, _) in zip(outputs, data, strict=True):
        torch.testing.assert_close(out, reference(x), atol=1e-6, rtol=1e-5)
    inference = _builds(caplog)[len(training) :]  # the batch dim is known to change: symbolic from the start
    assert len(inference) == 1 and inference[0].startswith("ORT inference graph") and "symbolic" in inference[0]


class _Refused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_a_graph_the_exporter_refuses_with_symbolic_sizes_runs_per_shape_said_once(caplog, monkeypatch):
    """Where the exporter cannot keep a dim symbolic, the graph is exported once per shape: one warning with the
    reason, the numbers eager's."""
    from ort_trainer.module import _export

    real = _export.graph_to_onnx

    def refusing(traced):
        if traced.export_shapes is not None:
            raise SymbolicShapesError("Constraints violated (batch)! the exporter specialised it")
        return real(traced)

    monkeypatch.setattr(_export, "graph_to_onnx", refusing)
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")  # exported here, not taken from an earlier test's cache
    torch.manual_seed(0)
    model = _Refused()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(b, 20, generator=g), torch.randint(0, 4, (b,), generator=g)) for b in (8, 5, 3, 5)]
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _train(ORTModule(model), batches, torch.nn.functional.cross_entropy)
    expected = _train(reference, batches, torch.nn.functional.cross_entropy)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-6, rtol=1e-5)
    _assert_state_equal(model, reference, atol=1e-6, rtol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ort_trainer" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Constraints violated (batch)" in warnings[0] and "one graph per" in warnings[0]
    assert _kinds(caplog) == ["ORT forward graph", "ORT backward graph"] * 3  # sizes 8, 5 and 3; 5 again: none
