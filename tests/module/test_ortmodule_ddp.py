"""``DistributedDataParallel(ORTModule(model))`` over gloo ranks equals one eager process on the whole batch.

The ranks (tests/module/ortmodule_ddp_worker.py) train with torch's AdamW, ``clip_grad_norm_`` and, on the last
step, gradient accumulation over two batches with ``no_sync()`` (the reference: one step on both at once);
DDP's gradient hooks fire as ORTModule's backward hands the gradients to torch's autograd, and its buckets
are all-reduced as for any module. The reference here is one eager process on the whole batch (per-rank
means averaged = the batch mean).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.models import MLP, mlp_batches
from tests.module.ortmodule_ddp_worker import BATCH, STEPS
from tests.ranks import run_ranks


def _eager_whole_batch() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    batches = mlp_batches(STEPS + 1, batch=BATCH)
    for step in range(STEPS):
        x, label = batches[step] if step < STEPS - 1 else [torch.cat(t) for t in zip(*batches[step:], strict=True)]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), label)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        losses.append(loss.item())
    return losses, copy.deepcopy(model.state_dict())


def _check(world: int, tmp_path) -> None:
    out = tmp_path / "rank0.json"
    run_ranks(world, ["-m", "tests.module.ortmodule_ddp_worker", str(out)], timeout_s=300)
    got = json.loads(out.read_text())
    losses, weights = _eager_whole_batch()
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), atol=1e-5, rtol=1e-5)
    for key, value in weights.items():
        torch.testing.assert_close(torch.tensor(got["weights"][key]), value, atol=1e-5, rtol=1e-4)


@pytest.mark.processes
def test_two_gloo_ranks_equal_one_eager_process_on_the_whole_batch(tmp_path):
    _check(2, tmp_path)


@pytest.mark.processes
@pytest.mark.hf_long  # 4 processes on the 2-core CI machine: run by `make test-hf` with the other long comparisons
def test_four_gloo_ranks_equal_one_eager_process_on_the_whole_batch(tmp_path):
    _check(4, tmp_path)
