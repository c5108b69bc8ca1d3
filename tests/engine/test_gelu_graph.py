"""The exact GELU's forward and backward share one ``erf`` in a training graph (`graph.autograd._gelu`).

Left to the exporter and PyTorch's decomposition, each exact GELU cost two ``Erf`` nodes and sixteen elementwise
nodes in all; written with the same ``cdf`` subexpression, the exporter merges the backward's copy into the
forward's. The tanh approximation keeps its own translation. Losses and gradients must stay PyTorch's, at every
batch size the one graph serves.
"""

from __future__ import annotations

import collections
import copy

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions

from ort_trainer import ORTModule, ORTTrainer, optim
from ort_trainer.graph.autograd import training_decompositions

DESC = {"inputs": [("x", ["batch", 12]), ("target", ["batch", 3])], "outputs": [("loss", [], True)]}


class GeluMLP(torch.nn.Module):
    """Two exact GELUs and one tanh GELU between linear layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(i, o) for i, o in ((12, 40), (40, 40), (40, 40), (40, 3)))

    def forward(self, x):
        x = F.gelu(self.a(x))
        x = F.gelu(self.b(x), approximate="tanh")
        return self.d(F.gelu(self.c(x)))


def mse(y, target):
    return F.mse_loss(y, target)


def _batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(rows, 12, generator=g), torch.randn(rows, 3, generator=g)  # inputs to well past |x| = 5


def test_an_exact_gelu_computes_erf_once_and_trains_as_pytorch_at_two_batch_sizes(tmp_path):
    torch.manual_seed(0)
    model = GeluMLP()
    reference = copy.deepcopy(model)
    gradient_graph = tmp_path / "gradient.onnx"
    trainer = ORTTrainer(
        model,
        DESC,
        optim.SGDConfig(lr=0.5),
        loss_fn=mse,
        options={
            "utils": {"engine": "autograd", "grad_norm_clip": False, "graph_cache": False},
            "debug": {"graph_save_paths": {"model_with_gradient_graph_path": str(gradient_graph)}},
        },
    )
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step, rows in enumerate((16, 5, 16, 5)):
        x, target = _batch(rows, step)
        got = trainer.train_step(x, target)
        opt.zero_grad()
        expected = mse(reference(x), target)
        expected.backward()
        opt.step()
        torch.testing.assert_close(got, expected.detach(), rtol=1e-6, atol=1e-6)
        state = trainer.state_dict(pytorch_format=True)
        for key, value in reference.state_dict().items():  # w - 0.5 * grad: the gradients, step by step
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")

    graph = onnx.load(str(gradient_graph)).graph
    ops = collections.Counter(node.op_type for node in graph.node)
    assert ops["Erf"] == 2, ops  # one per exact GELU: its backward reads the forward's
    assert ops["Exp"] == 2, ops  # each exact GELU's backward: exp(s * s), s = x / sqrt(2)
    assert ops["Tanh"] == 2, ops  # the tanh GELU as before: the exporter's forward, PyTorch's backward
    readers = collections.Counter(name for node in graph.node for name in node.input)
    producers = {out: node for node in graph.node for out in node.output}
    for erf in (n for n in graph.node if n.op_type == "Erf"):
        cdf = next(
            n
            for n in graph.node
            if producers.get(n.input[0]) is not None
            and n.op_type == "Mul"
            and producers[n.input[0]].input[0] == erf.output[0]
        )  # (erf + 1) * 0.5
        assert readers[cdf.output[0]] == 2, cdf  # x * cdf (the forward) and cdf + x * pdf (the backward)


def test_ortmodule_gradients_of_an_exact_gelu_are_pytorchs_at_two_batch_sizes():
    torch.manual_seed(0)
    model = GeluMLP()
    wrapped = ORTModule(copy.deepcopy(model))
    for step, rows in enumerate((16, 5)):
        x, target = _batch(rows, step)
        got = mse(wrapped(x), target)
        got.backward()
        expected = mse(model(x), target)
        expected.backward()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}")
            p.grad = q.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_gelu_decompositions_are_pytorchs_kernels(dtype):
    """Against aten's own CPU kernels, half precision computed in float32 and rounded once, as they compute it.
    In float32 the two differ by the last bits of two erf implementations (where 1 + erf cancels: x < -5)."""
    table = training_decompositions()
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-20, 20, 4001), 3 * torch.randn(4000, generator=g)]).to(dtype)
    grad = torch.randn(x.shape, generator=g).to(dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(table[aten.gelu.default](x), aten.gelu(x), **tolerance)
    torch.testing.assert_close(table[aten.gelu_backward.default](grad, x), aten.gelu_backward(grad, x), **tolerance)
    assert table[aten.gelu.default](x, approximate="tanh") is NotImplemented  # kept whole: the exporter's
    core = core_aten_decompositions()[aten.gelu_backward.default]  # the tanh one: PyTorch's decomposition, as before
    tanh = table[aten.gelu_backward.default](grad, x, approximate="tanh")
    torch.testing.assert_close(tanh, core(grad, x, approximate="tanh"), rtol=0, atol=0)
