"""Module patterns from real models: position ids sliced from a buffer (BERT, RoBERTa, T5's position bias...),
parameters the forward never uses. Both train exactly like torch.

The first one used to abort the process (with the Gather -> GatherND rewrite) or give a silently wrong gradient
(without it): ORT's gradient builder takes the dims that onnx shape inference could not infer (named ``unk__N``)
to equal the other operand's dims in a broadcast, so ``positions[1, seq] + tokens[batch, seq]`` got no ReduceSum."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.models import mlp_batches
from tests.paths import REPO

ce = torch.nn.functional.cross_entropy

SLICED_POSITIONS = textwrap.dedent(
    """
    import copy, sys, torch
    from ort_trainer import ORTTrainer, optim

    class Positions(torch.nn.Module):  # the HF pattern: position_ids[:, :seq] of a registered buffer
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(16, 4)
            self.positions = torch.nn.Embedding(16, 4)
            self.register_buffer("position_ids", torch.arange(16).expand((1, -1)), persistent=False)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, ids):
            positions = self.position_ids[:, : ids.shape[1]]
            return self.head((self.tokens(ids) + self.positions(positions)).mean(1))

    torch.manual_seed(0)
    model = Positions()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids, label = torch.randint(0, 16, (2, 8), generator=g), torch.randint(0, 3, (2,), generator=g)
        got = trainer.train_step(ids, label).item()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(ids), label)
        loss.backward()
        opt.step()
        assert abs(got - loss.item()) < 1e-5, (got, loss.item())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)[name], value, atol=1e-6, rtol=1e-5)
    print("OK")
    """
)


@pytest.mark.processes
def test_position_ids_sliced_from_a_buffer_train_like_torch():
    """In a subprocess: before the fix ORT aborted it (std::vector assertion in GatherNDGrad)."""
    done = subprocess.run(
        [sys.executable, "-c", SLICED_POSITIONS], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK")


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 16)
        self.unused = torch.nn.Linear(16, 16)  # e.g. a pooler the chosen head does not call
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


DESC = {"inputs": [("x", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]}


def test_parameters_the_graph_does_not_use_stay_as_torch_leaves_them():
    torch.manual_seed(0)
    model = WithUnused()
    reference = copy.deepcopy(model)
    config = optim.AdamConfig(lr=0.05, lambda_coef=0.1)  # weight decay would move them if they were updated
    trainer = ORTTrainer(model, DESC, config, loss_fn=ce, options={"utils": {"grad_norm_clip": False}})
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    before = trainer.state_dict()
    for x, label in mlp_batches(4):
        got = trainer.train_step(x, label).item()
        opt.zero_grad()
        loss = ce(reference(x), label)
        loss.backward()
        opt.step()
        assert abs(got - loss.item()) < 1e-5
    state = trainer.state_dict()
    assert list(state["optimizer"]) == list(before["optimizer"])  # the layout did not change at the build
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)[name], value, atol=2e-6, rtol=1e-5)
    assert torch.equal(state["model"]["full_precision"]["unused.weight"], model.unused.weight.detach())
    assert not state["optimizer"]["unused.weight"]["Moment_1"].any()
    assert state["optimizer"]["unused.weight"]["Update_Count"].tolist() == [5]  # counters move with the step
