"""One rank of a Megatron test: trains a model with horizontal_parallel_size H (world = D x H), dumps results.

Ranks take their data-parallel replica's share of a fixed global batch (rank // H). With WORLD_SIZE
unset it runs the same training in a single process (the reference). Writes the losses and the full
weights (slices joined over the horizontal group) with `checkpoint.save`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.models import MLP, MLP_DESC, mlp_batches


def build(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(hidden=16), MLP_DESC, torch.nn.functional.cross_entropy
    from tests.hf_tiny import GPT2, HF_CLASSIFIER_DESC, HF_DESC, BertClassifier, token_loss  # transformers: slow import

    if kind == "gpt2":
        return GPT2(layers=2, d_model=16), HF_DESC, token_loss
    return BertClassifier(layers=2, d_model=16), HF_CLASSIFIER_DESC, token_loss


def batches(kind: str, steps: int):
    if kind == "mlp":
        return mlp_batches(steps, batch=8)
    from tests.hf_tiny import classifier_batch, lm_batch

    if kind == "bert":
        return [classifier_batch(batch=4, seed=s) for s in range(steps)]
    # Two data-parallel halves padded alike: the token-mean losses of the replicas then average to the
    # global batch's token mean, which the one-process reference computes (unequal halves would not).
    halves = [[lm_batch(batch=2, seed=2 * s + k) for k in range(2)] for s in range(steps)]
    return [tuple(torch.cat(parts) for parts in zip(*pair, strict=True)) for pair in halves]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--h", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--sgd", action="store_true")
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--start", type=int, default=0, help="first batch (after --load)")
    parser.add_argument("--load", nargs="*", help="checkpoint files (or a manifest) to load before training")
    parser.add_argument("--save", help="save a checkpoint at the end; '{rank}' is filled in (one file per rank)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    model, desc, loss_fn = build(args.model)
    options = {
        "distributed": {
            "world_size": world,
            "world_rank": rank,
            "horizontal_parallel_size": args.h,
            "deepspeed_zero_optimization": {"stage": args.zero},
        },
        "batch": {"gradient_accumulation_steps": args.accumulation},
    }
    config = (
        optim.SGDConfig(lr=0.5)
        if args.sgd
        else optim.AdamConfig(lr=0.01, lambda_coef=0.01, max_norm_clip=args.clip, epsilon=args.eps)
    )
    trainer = ORTTrainer(model, desc, config, loss_fn=loss_fn, options=options)
    if args.load:
        trainer.load_checkpoint(*args.load)
    replicas, replica = world // args.h, rank // args.h
    losses = []
    for batch in batches(args.model, args.start + args.steps)[args.start :]:
        mine = [t.chunk(replicas)[replica] for t in batch]
        losses.append(float(trainer.train_step(*mine)))
    evaluated = torch.tensor([float(trainer.eval_step(*[t.chunk(replicas)[replica] for t in batch]))])
    if args.save:
        trainer.save_checkpoint(args.save.format(rank=rank), overwrite=True)
    losses = torch.tensor(losses)
    if world > 1:  # the global batch's loss: the mean over replicas (horizontal ranks agree on theirs)
        dist.all_reduce(losses)
        losses /= world
        dist.all_reduce(evaluated)
        evaluated /= world
    weights = trainer.state_dict(pytorch_format=True)
    horizontal = trainer.trainer_state.horizontal
    if horizontal is not None:
        for name, spec in horizontal.specs.items():
            shards = [torch.empty_like(weights[name]) for _ in range(args.h)]
            dist.all_gather(shards, weights[name].contiguous(), group=horizontal.grid.horizontal_group)
            weights[name] = spec.join(shards)
    if rank == 0:
        checkpoint.save({"losses": losses, "eval": evaluated, "weights": weights}, args.out, overwrite=True)
    trainer.close()


if __name__ == "__main__":
    main()
