"""``torch.compile(model, backend="ort_trainer")``: the graphs Dynamo captures run in ONNX Runtime.

Unlike `ORTModule` the backend allows graph breaks: the code around a break runs in eager PyTorch, each
captured piece (forward and backward) in ONNX Runtime. The backend is registered through torch's
``torch_dynamo_backends`` entry point (setup.py), so the name works without importing ort_trainer.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from ort_trainer.module import ort_backend
from tests.paths import REPO


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo remembers, per code object, the sizes it has seen (automatic dynamic shapes): a test of this worker
    that compiled `Linear.forward` at two batch sizes made the next test's first graph symbolic already, and the
    graph counts below depend on the first being static."""
    torch._dynamo.reset()
    yield


class _Broken(torch.nn.Module):
    """Two Linear layers with a graph break between them (as a print or a call Dynamo cannot trace makes)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


def test_graph_breaks_run_their_pieces_in_onnx_runtime_and_train_as_in_eager(caplog):
    torch.manual_seed(0)
    model = _Broken()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=ort_backend)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _sgd(compiled, batches[:1])
        first = _built(caplog)
        losses += _sgd(compiled, batches[1:])
    assert first.count("ORT forward graph") >= 2  # the pieces before and after the break
    assert first.count("ORT backward graph") == first.count("ORT forward graph")
    assert _built(caplog) == first  # built once
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_sgd(reference, batches)), atol=1e-6, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_size_dynamo_makes_symbolic_runs_in_onnx_runtime_one_graph_for_every_later_size(caplog):
    """A graph with symbolic sizes ran in eager PyTorch (with a warning); it is one ORT graph for all sizes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh())
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=ort_backend)
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        for batch in (3, 5, 7, 2, 5):  # the second size: Dynamo recompiles with the batch dim symbolic
            x = torch.randn(batch, 6)
            got, expected = compiled(x), reference(x)
            got.square().sum().backward()
            expected.square().sum().backward()
            torch.testing.assert_close(got, expected)
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ORT ")]
    assert _built(caplog) == ["ORT forward graph", "ORT backward graph"] * 2  # batch 3's, then one for the rest
    assert all("symbolic sizes" in message for message in built[2:]) and "symbolic" not in built[0]
    assert not [r for r in caplog.records if r.name == "ort_trainer" and r.levelno >= logging.WARNING]


def _built(caplog) -> list[str]:
    return [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("ORT ")]


def _sgd(module, batches) -> list[float]:
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for x, label in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(x), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.processes
def test_the_backend_is_found_by_name_without_importing_ort_trainer(tmp_path):
    """The entry point of setup.py, as pip installs it (its metadata written by ``setup.py egg_info``)."""
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=REPO, check=True, timeout=120
    )
    script = textwrap.dedent(
        """
        import sys
        import torch
        assert "ort_trainer" not in sys.modules
        torch.manual_seed(0)
        model, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
        out = torch.compile(model, backend="ort_trainer")(x)
        out.sum().backward()
        assert "ort_trainer.module" in sys.modules, sorted(m for m in sys.modules if m.startswith("ort_trainer"))
        torch.testing.assert_close(out, model(x))
        torch.testing.assert_close(model.weight.grad, x.sum(0).expand(2, 4))
        print("compiled by", torch._dynamo.list_backends().count("ort_trainer"))
        """
    )
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled by 1" in result.stdout
