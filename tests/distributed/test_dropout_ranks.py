"""Two gloo ranks with ZeRO-1 and dropout 0.1 resume bit for bit, and draw different masks per rank.

The run seed is rank 0's on every rank (agreed at construction, stored in every rank file); each
step's seed mixes in the rank, so two ranks fed the same batch get different losses.
"""

from __future__ import annotations

import pytest
import torch

from ort_trainer import checkpoint
from tests.ranks import run_ranks


@pytest.mark.processes
def test_zero_ranks_with_dropout_resume_exactly_and_draw_their_own_masks(tmp_path):
    for phase in ("full", "resume"):
        run_ranks(2, ["-m", "tests.distributed.dropout_ranks_worker", phase, str(tmp_path)])
    full = [checkpoint.load(tmp_path / f"full-rank{r}.h5") for r in range(2)]
    resumed = [checkpoint.load(tmp_path / f"resume-rank{r}.h5") for r in range(2)]
    assert full[0]["seed"] == full[1]["seed"] == 0  # rank 0's torch seed
    assert full[0]["same_batch"] != full[1]["same_batch"]  # same batch, same weights: the masks differ
    for rank in range(2):
        assert torch.cat([full[rank]["first"], resumed[rank]["losses"]]).tolist() == full[rank]["losses"].tolist()
        for name, value in full[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), f"rank {rank}: {name}"
    sets = checkpoint.aggregate_checkpoints(checkpoint.manifest_path(tmp_path / "ck.ortcp"))
    assert sets["train_step_info"] == {"optimization_step": 2, "step": 2, "seed": 0}
