"""Data parallel and ZeRO-1 with ranks whose batches differ in size and length at every step (issue V): each rank
runs one symbolic training graph, and the weights equal one PyTorch process that averages the ranks' losses (as
DistributedDataParallel averages their gradients) under AdamW."""

from __future__ import annotations

import pytest
import torch

from ort_trainer import checkpoint
from tests.distributed.varlen_ranks_worker import DECAY, LR, SHAPES, batch
from tests.hf_tiny import GPT2, token_loss
from tests.ranks import run_ranks


def _reference() -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    torch.manual_seed(0)
    model = GPT2(layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, eps=1e-8)
    losses = []
    for step in range(len(SHAPES)):
        per_rank = [token_loss(model(ids, mask), label) for ids, mask, label in (batch(step, r) for r in range(2))]
        opt.zero_grad()
        torch.stack(per_rank).mean().backward()
        opt.step()
        losses.append([float(x.detach()) for x in per_rank])
    return model.state_dict(), losses


@pytest.mark.processes
@pytest.mark.parametrize("zero", [0, 1])
def test_ranks_with_batches_of_different_lengths_train_one_graph_each_and_equal_torch(tmp_path, zero):
    run_ranks(2, ["-m", "tests.distributed.varlen_ranks_worker", str(zero), str(tmp_path)])
    expected, expected_losses = _reference()
    ranks = [checkpoint.load(tmp_path / f"rank{r}.h5") for r in range(2)]
    for rank, state in enumerate(ranks):
        assert state["builds"] == 1, f"rank {rank} built {state['builds']} training graphs"
        losses = torch.tensor([s[rank] for s in expected_losses])
        torch.testing.assert_close(state["losses"], losses, rtol=1e-5, atol=1e-6)
        for name, value in expected.items():  # atol: the attention key bias's true gradient is 0; Adam scales
            # its rounding noise (~1e-9) up to steps of ~1e-5 in both runs, as in tests/hf/common.py
            torch.testing.assert_close(state["weights"][name], value, rtol=1e-4, atol=2e-5, msg=f"rank {rank}: {name}")
