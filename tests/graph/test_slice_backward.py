"""The autograd engine's ``slice_backward`` (`graph.autograd._decompositions`): a slice's gradient is that gradient
padded with zeros, one tensor of the input's size, where PyTorch's decomposition writes zeros and scatters into
them (exported as the zeros, two transposes and a ``ScatterND`` per sliced dim: five logits-sized tensors at the
top of a shifted LM loss's backward). Equal to PyTorch's kernel for every bound form, and at every sequence length
on one symbolic graph."""

from __future__ import annotations

import sys

import onnx
import pytest
import torch
from onnx import numpy_helper

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph.autograd._decompositions import training_decompositions

SIZES = [5, 7, 9]
CASES = [  # (dim, start, end, step): the bounds a user's indexing gives aten.slice
    (1, 0, -1, 1),  # logits[:, :-1]
    (1, 1, sys.maxsize, 1),  # labels[:, 1:]
    (0, 0, sys.maxsize, 1),  # x[:, ...]: the whole dim
    (1, 2, 4, 1),  # x[:, 2:4]
    (-1, -3, sys.maxsize, 1),  # x[..., -3:]
    (1, 1, 6, 2),  # a step: PyTorch's own decomposition
    (1, 3, 100, 1),  # an end past the size
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:3]) for c in CASES])
def test_the_decomposed_slice_backward_equals_pytorch(case):
    dim, start, end, step = case
    sizes = [4, 7, 3]
    g = torch.Generator().manual_seed(0)
    sliced = torch.randn(sizes, generator=g, dtype=torch.float64)[
        (slice(None),) * (dim % 3) + (slice(start, end, step),)
    ]
    grad = torch.randn(sliced.shape, generator=g, dtype=torch.float64)
    args = (grad, sizes, dim, start, end, step)
    expected = torch.ops.aten.slice_backward.default(*args)
    got = training_decompositions()[torch.ops.aten.slice_backward.default](*args)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


class _ShiftedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 8)
        self.head = torch.nn.Linear(8, 40)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _shifted_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1))


def test_a_shifted_lm_loss_trains_like_torch_at_every_length_without_scattering_into_zeros(tmp_path):
    torch.manual_seed(0)
    model, reference = _ShiftedLM(), _ShiftedLM()
    reference.load_state_dict(model.state_dict())
    desc = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    saved = {"model_with_training_graph_path": str(tmp_path / "train.onnx")}
    options = {"utils": {"engine": "autograd", "graph_cache": False}, "debug": {"graph_save_paths": saved}}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.5), loss_fn=_shifted_loss, options=options)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for length in SIZES:
        ids, labels = torch.randint(0, 40, (3, length), generator=g), torch.randint(0, 40, (3, length), generator=g)
        loss = trainer.train_step(ids, labels)
        torch_optimizer.zero_grad()
        expected = _shifted_loss(reference(ids), labels)
        expected.backward()
        torch_optimizer.step()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=name)
    nodes = onnx.load(tmp_path / "train.onnx").graph.node
    scatters = [  # the slice's gradient written into zeros (the embedding's gradient is a ScatterND that adds)
        n.name for n in nodes if n.op_type == "ScatterND" and onnx.helper.get_node_attr_value(n, "reduction") != b"add"
    ]
    assert not scatters and "Pad" in [n.op_type for n in nodes], scatters
    constants = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "train.onnx").graph.initializer}
    whole = [  # ``logits[:, :-1]`` slices dim 0 whole too: a view in PyTorch, a copy as an ONNX Slice
        n.name
        for n in nodes
        if n.op_type == "Slice"
        and (constants.get(n.input[1]) == 0).all()
        and (constants.get(n.input[2]) >= 2**62).all()
    ]
    assert not whole, whole
