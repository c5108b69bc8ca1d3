"""One rank of a multi-process test (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the launcher).

Trains the MLP on this rank's shard of a fixed global batch, optionally loads / saves checkpoints,
and dumps what the test compares with `checkpoint.save`. The trainer creates the process group; like a
legacy script, the worker leaves tearing it down to ort_trainer's exit hook, or calls
``trainer.close()`` with ``--close``. ``--report-exit FILE`` writes, at exit after ort_trainer's hook
has run, whether a process group was still initialized.
"""

from __future__ import annotations

import argparse
import atexit
import os

import torch
import torch.distributed as dist

from ort_trainer import ORTTrainer, checkpoint, optim
from ort_trainer.checkpoint import CheckpointManager
from tests.models import MLP, MLP_DESC, mlp_batches


def make_trainer(zero: int, clip: bool, optimizer: str = "adam") -> ORTTrainer:
    torch.manual_seed(int(os.environ.get("RANK", 0)) + 100)  # different init per rank: rank 0's must win
    config = optim.AdamConfig(lr=0.02, lambda_coef=0.01, max_norm_clip=0.5) if optimizer == "adam" else None
    config = config or optim.SGDConfig(lr=0.1)
    options = {
        "distributed": {"deepspeed_zero_optimization": {"stage": zero}},
        "utils": {"grad_norm_clip": clip},
        "batch": {"gradient_accumulation_steps": 2},
    }
    return ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy, options=options)


def shard(batch, rank: int, world: int):
    return [t.chunk(world)[rank] for t in batch]


def save(trainer: ORTTrainer, args, rank: int) -> None:
    target = args.save.format(rank=rank, step=trainer.train_step_info.step)
    try:
        trainer.save_checkpoint(target, overwrite=args.overwrite, async_save=args.async_save)
    except Exception as error:
        if not args.expect_save_error or args.expect_save_error not in str(error):
            raise
    else:
        if args.expect_save_error:
            raise SystemExit(f"rank {rank}: save did not fail")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--clip", type=int, default=1)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=8)
    parser.add_argument("--load", nargs="*")
    parser.add_argument("--save", help="path; '{rank}' / '{step}' in it are filled in (legacy: one path per rank)")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: only at the end)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--async-save", action="store_true", help="save in the background while training goes on")
    parser.add_argument(
        "--manager",
        help="save every --save-every steps through a CheckpointManager here (keep_last=1), "
        "after restoring its latest checkpoint",
    )
    parser.add_argument("--expect-save-error", help="the save must fail on this rank with this text")
    parser.add_argument("--close", action="store_true", help="call trainer.close() at the end")
    parser.add_argument("--report-exit", help="write 'initialized=<bool>' here at exit, after ort_trainer's hook")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.report_exit:  # registered before the trainer exists: atexit runs it after ort_trainer's hook
        atexit.register(_report_exit, f"{args.report_exit}.rank{os.environ['RANK']}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = make_trainer(args.zero, bool(args.clip), args.optimizer)
    if args.load:
        trainer.load_checkpoint(*args.load)
    start, manager = args.start, None
    if args.manager:
        manager = CheckpointManager(args.manager, keep_last=1, async_save=args.async_save)
        restored = manager.restore(trainer)
        start = restored.step if restored else start
    losses = []
    for step, batch in enumerate(mlp_batches(args.stop, batch=12)[start:], start=start + 1):
        losses.append(trainer.train_step(*shard(batch, rank, world)).item())
        if args.save and args.save_every and step % args.save_every == 0 and step < args.stop:
            save(trainer, args, rank)
        if manager is not None and step % args.save_every == 0:
            manager.save(trainer, step, metrics={"loss": losses[-1]})
    if args.save:
        save(trainer, args, rank)
    state = {
        "weights": trainer.state_dict(pytorch_format=True),
        "losses": torch.tensor(losses),
        "optimizer_numel": sum(
            v.numel()
            for entry in trainer.state_dict()["optimizer"].values()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        ),
        "train_step_info": trainer.train_step_info.state_dict(),
    }
    checkpoint.save(state, os.path.join(args.out, f"rank{rank}.h5"), overwrite=True)
    if args.close:
        trainer.close()


def _report_exit(path: str) -> None:
    with open(path, "w") as f:
        f.write(f"initialized={dist.is_initialized()}")


if __name__ == "__main__":
    main()
