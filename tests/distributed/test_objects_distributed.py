"""Checkpoints of a custom loop's dict of objects on 2 gloo ranks (spawned processes, group torn down at exit).

DDP: rank 0 writes the whole state once and every rank restores it. ``ZeroRedundancyOptimizer``: every rank's
shard goes into the rank set; the set restores at the same world size (training on is bit-exact), into a plain
AdamW of one process and into a ZeRO optimizer of 1 rank (checked against ZeRO's own consolidated
``state_dict()``), and ``python -m ort_trainer.checkpoint aggregate`` makes one file of it that loads the same.
The checks run in ``tests/distributed/objects_dist_worker.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint.format import decode_user_value
from ort_trainer.checkpoint.objects import load_objects
from tests.paths import REPO
from tests.ranks import run_ranks
from tests.trees import assert_trees_equal

pytestmark = pytest.mark.processes


def test_ddp_writes_once_and_zero_shards_aggregate_and_load_into_any_world_size(tmp_path):
    logs = run_ranks(2, ["-m", "tests.distributed.objects_dist_worker", "ranks", str(tmp_path)])
    assert all(log.rstrip().endswith("ok") for log in logs), logs
    run_ranks(1, ["-m", "tests.distributed.objects_dist_worker", "one", str(tmp_path)])

    manifest = tmp_path / "zero" / "ckpt-000000003.ortcp.manifest.json"
    out = tmp_path / "aggregated.ortcp"
    cli = [sys.executable, "-m", "ort_trainer.checkpoint", "aggregate", str(manifest), "-o", str(out)]
    done = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    aggregated = checkpoint.load(out)
    assert aggregated["trainer_options"]["world_size"] == 1 and aggregated["trainer_options"]["zero_stage"] == 0
    expected = checkpoint.load(tmp_path / "consolidated.ortcp")["state"]
    for path in (out, manifest):  # the aggregated file, and the set itself, in this single process
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Linear(12, 3)
        )
        named = list(model.named_parameters())
        adamw = torch.optim.AdamW(
            [{"params": [p for n, p in named if "weight" in n]}, {"params": [p for n, p in named if "bias" in n]}]
        )
        load_objects({"model": model, "optimizer": adamw}, path)
        assert_trees_equal({str(k): v for k, v in adamw.state_dict()["state"].items()}, expected)
        saved_groups = decode_user_value(aggregated["stateful"]["optimizer"], "stateful/optimizer")["param_groups"]
        assert [g["lr"] for g in adamw.param_groups] == [g["lr"] for g in saved_groups]

    from ort_trainer import ORTTrainer, optim
    from tests.models import MLP, MLP_DESC

    trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    with pytest.raises(ValueError, match=r"holds a dict of objects \['model', 'optimizer', 'scheduler'\]"):
        trainer.load_checkpoint(manifest)  # an ORTTrainer is told what loads the set
