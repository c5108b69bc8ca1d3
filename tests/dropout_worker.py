"""Run in fresh processes by tests/trainer/test_dropout_resume.py: train a model with dropout 0.1.

``python -m tests.dropout_worker <phase> <folder>``, for every model: phase ``first`` runs STEPS steps
uninterrupted, then (a new trainer) SPLIT steps and saves a checkpoint; ``resume`` builds a new trainer
(another init seed: the weights come from the checkpoint), loads it and runs the rest. Each run dumps
its losses and final state.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import transformers

from ort_trainer import ORTTrainer, checkpoint, optim
from tests.hf_tiny import tiny_gpt2_config

STEPS, SPLIT = 6, 3
VOCAB = 64


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(20, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _gpt2():
    config = tiny_gpt2_config(VOCAB, dropout=None)  # resid/embd/attn dropout: GPT-2's default 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config)


def _lm_loss(out, labels):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


MODELS = {
    "mlp": (
        DropoutMLP,
        {"inputs": [("x", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]},
        torch.nn.functional.cross_entropy,
    ),
    "gpt2": (
        _gpt2,
        {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])], "outputs": [("loss", [], True)]},
        _lm_loss,
    ),
}


def batches(name: str) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return [(torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]
    ids = [torch.randint(1, VOCAB, (2, 9), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in ids]


def make_trainer(name: str, init_seed: int) -> ORTTrainer:
    build, desc, loss_fn = MODELS[name]
    torch.manual_seed(init_seed)
    options = {"debug": {"deterministic_compute": True}}
    return ORTTrainer(build(), desc, optim.AdamConfig(lr=1e-3), loss_fn=loss_fn, options=options)


def run(trainer: ORTTrainer, name: str, start: int, stop: int, dump: Path) -> None:
    losses = [trainer.train_step(*batch).item() for batch in batches(name)[start:stop]]
    state = trainer.state_dict(pytorch_format=True)
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    checkpoint.save(state, dump, overwrite=True)


def main(phase: str, folder: str) -> None:
    out = Path(folder)
    for name in MODELS:
        if phase == "first":
            run(make_trainer(name, 0), name, 0, STEPS, out / f"{name}-full.h5")
            trainer = make_trainer(name, 0)
            run(trainer, name, 0, SPLIT, out / f"{name}-first.h5")
            trainer.save_checkpoint(out / f"{name}.ortcp", overwrite=True)
        else:
            trainer = make_trainer(name, 5)  # another torch seed: what matters comes from the checkpoint
            trainer.load_checkpoint(out / f"{name}.ortcp")
            run(trainer, name, SPLIT, STEPS, out / f"{name}-resumed.h5")


if __name__ == "__main__":
    main(*sys.argv[1:])
