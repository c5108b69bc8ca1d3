"""One rank of the interop distributed tests (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the launcher).

``partial``: loads on only some ranks must raise on every rank at the next step, never mix states.
``full``: in-memory full state vs aggregation of a save, per-rank user_dicts, broadcast_from_rank0.
Results go to ``<out>/rank<r>.h5`` (`checkpoint.save`) for the test to compare.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ort_trainer import ORTTrainer, StateDictOptions, checkpoint, optim
from tests.models import MLP, MLP_DESC, mlp_batches

FULL = StateDictOptions(full_state_dict=True)


def make_trainer(seed: int) -> ORTTrainer:
    torch.manual_seed(seed)
    config = optim.AdamConfig(lr=0.02, lambda_coef=0.01)
    scheduler = optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=20, warmup=0.2)
    options = {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}, "lr_scheduler": scheduler}
    return ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy, options=options)


def shard(batch, rank: int, world: int):
    return [t.chunk(world)[rank] for t in batch]


def step_error(trainer: ORTTrainer, batch) -> str:
    """'' if the step ran, else the error's type and message."""
    try:
        trainer.train_step(*batch)
    except Exception as error:  # the test compares the message
        return f"{type(error).__name__}: {error}"
    return ""


def partial(out: Path, rank: int, world: int) -> dict:
    batches = [shard(b, rank, world) for b in mlp_batches(8, batch=12)]
    trainer = make_trainer(100 + rank)
    for batch in batches[:2]:
        trainer.train_step(*batch)
    path = out / "ck.ortcp"
    trainer.save_checkpoint(path)
    other = MLP().state_dict()
    results = {}
    if rank == 0:
        trainer.load_state_dict(other)
    results["rank0_load_state_dict"] = step_error(trainer, batches[2])
    results["again"] = step_error(trainer, batches[2])  # still refused: the ranks still differ
    trainer.load_checkpoint(checkpoint.manifest_path(path))  # every rank: the states agree again
    results["all_ranks_load"] = step_error(trainer, batches[2])
    results["weights"] = trainer.state_dict(pytorch_format=True)  # the same on every rank again
    if rank == 1:
        trainer.load_checkpoint(checkpoint.manifest_path(path))
    results["rank1_load_checkpoint"] = step_error(trainer, batches[3])
    fresh = make_trainer(200 + rank)
    if rank == 0:
        fresh.load_state_dict(other)
    results["rank0_load_before_first_step"] = step_error(fresh, batches[0])
    return results


def full(out: Path, rank: int, world: int) -> dict:
    batches = [shard(b, rank, world) for b in mlp_batches(8, batch=12)]
    trainer = make_trainer(100 + rank)
    for batch in batches[:4]:
        trainer.train_step(*batch)
    results = {
        "full": trainer.state_dict(options=FULL),
        "offloaded": trainer.state_dict(options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        "torch_optimizer": trainer.optimizer_state_dict(options=FULL)["state"],
    }
    path = out / "ck.ortcp"
    trainer.save_checkpoint(path, user_dict={"rank": rank, "sampler": {"offset": 10 * rank}})
    results["user_dict"] = checkpoint.encode_user_dict(trainer.load_checkpoint(checkpoint.manifest_path(path)))
    fresh = make_trainer(300 + rank)  # another start on every rank: rank 0's loaded state must reach all
    source = checkpoint.aggregate_checkpoints(checkpoint.manifest_path(path)) if rank == 0 else {}
    source.pop("user_dict", None)
    source.pop("rank_user_dicts", None)
    fresh.load_state_dict(source, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    results["broadcast"] = fresh.state_dict(options=FULL)
    results["continued"] = torch.tensor([trainer.train_step(*b).item() for b in batches[4:]])
    results["continued_broadcast"] = torch.tensor([fresh.train_step(*b).item() for b in batches[4:]])
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["partial", "full"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    results = {"partial": partial, "full": full}[args.scenario](out, rank, world)
    checkpoint.save(results, out / f"rank{rank}.h5", overwrite=True)


if __name__ == "__main__":
    main()
