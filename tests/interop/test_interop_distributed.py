"""Distributed state for PyTorch habits (2 ranks, ZeRO-1, gloo on 127.0.0.1).

A load on only some ranks raises on every rank at the next step (never a silent mix); the in-memory
full state equals aggregating a save; every rank gets its own user_dict back; broadcast_from_rank0
gives every rank rank 0's exact weights and moments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ort_trainer import checkpoint
from tests.ranks import run_ranks
from tests.trees import assert_trees_equal

pytestmark = pytest.mark.processes  # every test here starts other processes

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def launch(world: int, out: Path, scenario: str) -> list[dict]:
    """Run `world` ranks of tests.interop.interop_worker; each writes its state to ``out/rank<r>.h5``."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(world, ["-m", "tests.interop.interop_worker", scenario, "--out", str(out)])
    return [checkpoint.load(out / f"rank{r}.h5") for r in range(world)]


def test_a_load_on_only_some_ranks_raises_on_every_rank(tmp_path):
    ranks = launch(2, tmp_path, "partial")
    for rank, result in enumerate(ranks):
        for key, loaded in (
            ("rank0_load_state_dict", [0]),
            ("again", [0]),
            ("rank1_load_checkpoint", [1]),
            ("rank0_load_before_first_step", [0]),
        ):
            message = result[key]
            assert message.startswith("RuntimeError: "), (rank, key, message)
            assert f"ranks {loaded} loaded a state that ranks {[r for r in (0, 1) if r not in loaded]}" in message, (
                rank,
                key,
                message,
            )
        assert result["all_ranks_load"] == "", (rank, result["all_ranks_load"])
    assert_trees_equal(ranks[0]["weights"], ranks[1]["weights"])


def test_full_state_user_dicts_and_broadcast_from_rank0(tmp_path):
    ranks = launch(2, tmp_path, "full")
    aggregated = checkpoint.aggregate_checkpoints(checkpoint.manifest_path(tmp_path / "ck.ortcp"))
    assert sorted(aggregated["rank_user_dicts"]) == ["0", "1"]
    aggregated.pop("user_dict")
    aggregated.pop("rank_user_dicts")
    for rank, result in enumerate(ranks):
        assert_trees_equal(result["full"], aggregated, f"rank {rank} full_state_dict")
        assert_trees_equal(result["broadcast"], aggregated, f"rank {rank} after broadcast_from_rank0")
        assert checkpoint.decode_user_dict(result["user_dict"]) == {"rank": rank, "sampler": {"offset": 10 * rank}}
        assert torch.equal(result["continued_broadcast"], result["continued"])
        moments = result["torch_optimizer"]["fc1.weight"]
        assert torch.equal(moments["exp_avg"], aggregated["optimizer"]["fc1.weight"]["Moment_1"])
    assert_trees_equal(ranks[0]["offloaded"], aggregated)
    assert ranks[1]["offloaded"] == {}  # full + cpu_offload: only rank 0 holds the state (torch's rule)
