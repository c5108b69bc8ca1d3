"""Run as ranks by tests/distributed/test_objects_distributed.py: checkpoints of a custom loop's objects under DDP
and with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (gloo on 127.0.0.1; RANK/WORLD_SIZE/MASTER_* set).

``python -m tests.distributed.objects_dist_worker ranks DIR`` (2 ranks): DDP (rank 0 writes the whole state once,
every rank restores it), then ZeRO (every rank writes its shard into a rank set, restore at the same world size
trains on bit-exactly, the united shards equal ZeRO's consolidated ``state_dict()``, which rank 0 saves for the test).
``python -m tests.distributed.objects_dist_worker one DIR`` (1 rank): the 2-rank set restored into a ZeRO optimizer
of 1 rank.
Every check is an assert: a failed one fails the rank, and the test shows its log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointManager
from ort_trainer.checkpoint.objects import load_objects
from tests.trees import assert_trees_equal

SAVED_AT, STEPS = 3, 5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Linear(12, 3))


def groups(module: torch.nn.Module) -> list[dict]:
    named = list(module.named_parameters())
    return [
        {"params": [p for n, p in named if "weight" in n]},
        {"params": [p for n, p in named if "bias" in n], "lr": 0.01},
    ]


def zero(module: torch.nn.Module) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(groups(module), optimizer_class=torch.optim.AdamW, lr=0.02, weight_decay=0.05)


def train(module, optimizer, scheduler, start: int, stop: int) -> None:
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())  # each rank its own batch
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        torch.nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def weights(module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


def ddp(folder: Path) -> None:
    rank = dist.get_rank()
    net = DDP(model())
    adamw = torch.optim.AdamW(groups(net), lr=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=STEPS)
    train(net, adamw, sched, 0, SAVED_AT)
    state = {"model": net, "optimizer": adamw, "scheduler": sched}
    manager = CheckpointManager(folder / "ddp")
    manager.save(state, SAVED_AT, user_dict={"rank": rank})
    dist.barrier()
    names = sorted(os.listdir(folder / "ddp"))
    assert names == ["ckpt-000000003.ortcp", "ort_trainer_checkpoints.json"], names  # one file, by rank 0
    stored = checkpoint.load(folder / "ddp" / names[0])
    assert sorted(stored["stateful"]["model"]) == sorted(net.module.state_dict())  # no "module." prefix
    torch.manual_seed(7)  # other initial weights
    fresh = DDP(
        torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Linear(12, 3))
    )
    fresh_adamw = torch.optim.AdamW(groups(fresh), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.CosineAnnealingLR(fresh_adamw, T_max=STEPS)
    restored = manager.restore({"model": fresh, "optimizer": fresh_adamw, "scheduler": fresh_sched})
    assert restored.user_dict == {"rank": 0}  # rank 0's: it wrote the state for all
    assert_trees_equal(fresh_adamw.state_dict(), adamw.state_dict())
    train(net, adamw, sched, SAVED_AT, STEPS)
    train(fresh, fresh_adamw, fresh_sched, SAVED_AT, STEPS)
    assert_trees_equal(weights(fresh), weights(net))


def zero_ranks(folder: Path) -> None:
    rank = dist.get_rank()
    net = DDP(model())
    opt = zero(net)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    train(net, opt, sched, 0, SAVED_AT)
    manager = CheckpointManager(folder / "zero")
    manager.save({"model": net, "optimizer": opt, "scheduler": sched}, SAVED_AT)
    dist.barrier()
    files = sorted(os.listdir(folder / "zero"))
    rank_files = [n for n in files if ".rank" in n]
    assert len(rank_files) == 2 and "ckpt-000000003.ortcp.manifest.json" in files, files
    shards = [set(checkpoint.load(folder / "zero" / n)["optimizer"]) for n in rank_files]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == {f"optimizer.{i}" for i in range(6)}, shards

    opt.consolidate_state_dict(to=0)
    if rank == 0:  # the united shards are ZeRO's own consolidated state; a plain AdamW of one process takes them
        consolidated = opt.state_dict()
        plain_model = model()
        plain = torch.optim.AdamW(groups(plain_model), lr=0.7)
        load_objects({"optimizer": plain, "model": plain_model}, folder / "zero" / "ckpt-000000003.ortcp.manifest.json")
        assert_trees_equal(plain.state_dict()["state"], consolidated["state"])
        for got, want in zip(plain.state_dict()["param_groups"], consolidated["param_groups"], strict=True):
            assert {k: got[k] for k in want} == want, (got, want)
        assert_trees_equal(weights(plain_model), weights(net.module))
        checkpoint.save({"state": {str(k): v for k, v in consolidated["state"].items()}}, folder / "consolidated.ortcp")

    fresh = DDP(model())
    fresh_opt = zero(fresh)
    fresh_sched = torch.optim.lr_scheduler.CosineAnnealingLR(fresh_opt, T_max=STEPS)
    assert manager.restore({"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched}).step == SAVED_AT
    train(net, opt, sched, SAVED_AT, STEPS)
    train(fresh, fresh_opt, fresh_sched, SAVED_AT, STEPS)
    assert_trees_equal(weights(fresh), weights(net))


def one_rank(folder: Path) -> None:
    """The 2-rank ZeRO set into a ZeRO optimizer of 1 rank: it now owns every parameter's state."""
    net = DDP(model())
    opt = zero(net)
    load_objects({"model": net, "optimizer": opt}, folder / "zero" / "ckpt-000000003.ortcp.manifest.json")
    opt.consolidate_state_dict(to=0)
    expected = checkpoint.load(folder / "consolidated.ortcp")["state"]
    assert_trees_equal({str(k): v for k, v in opt.state_dict()["state"].items()}, expected)


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if mode == "ranks":
            ddp(folder)
            zero_ranks(folder)
        else:
            one_rank(folder)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print("ok", flush=True)
