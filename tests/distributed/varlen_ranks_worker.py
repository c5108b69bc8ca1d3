"""One rank of tests/distributed/test_varlen_ranks.py: data parallel (ZeRO stage 0 or 1) on a tiny GPT-2 where
each rank's batches have their own batch size and sequence length at every step (what per-rank padding collators
and a length-grouped sampler give), on the autograd engine's symbolic graph.

Writes ``rank<R>.h5``: the weights after the run, the losses, the number of graphs built (log lines) and the
ZeRO stage."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.hf_tiny import GPT2, HF_DESC, token_loss

# per step, per rank: (rows, length); the ranks never agree on a shape, and rank 1's last batch is smaller
SHAPES = [[(3, 6), (2, 11)], [(4, 9), (4, 4)], [(2, 12), (3, 7)], [(3, 5), (1, 10)]]
LR, DECAY = 0.01, 0.01


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch rank ``rank`` trains on at ``step``: its last row right-padded, -100 labels on the padding."""
    rows, length = SHAPES[step][rank]
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(1, 50, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, length // 2 :] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.builds = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.builds += "phase 'trace and export the training graph'" in text or "new input shapes" in text


def main(zero: str, folder: str) -> None:
    rank = int(os.environ["RANK"])
    counter = _Count()
    logging.getLogger("ort_trainer").addHandler(counter)
    logging.getLogger("ort_trainer").setLevel(logging.INFO)
    torch.manual_seed(0)
    options = {
        "utils": {"engine": "autograd", "grad_norm_clip": False},
        "distributed": {"deepspeed_zero_optimization": {"stage": int(zero)}},
    }
    config = optim.AdamConfig(lr=LR, lambda_coef=DECAY)
    trainer = ORTTrainer(GPT2(layers=1), HF_DESC, config, loss_fn=token_loss, options=options)
    losses = [float(trainer.train_step(*batch(step, rank))) for step in range(len(SHAPES))]
    state = {"weights": trainer.state_dict(pytorch_format=True), "losses": torch.tensor(losses)}
    state |= {"builds": counter.builds}
    checkpoint.save(state, Path(folder) / f"rank{rank}.h5", overwrite=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
