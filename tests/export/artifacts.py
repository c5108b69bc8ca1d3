"""Shared by the training-artifact tests: the models, their batches, and a run of an artifact beside ORTTrainer.

`compare_runs` trains the same model from the same state for ``steps`` steps in ``ORTTrainer.train_step`` and in
the artifact (through `ArtifactRunner`, the reference driver), with the trainer's learning rate of each step, and
returns both loss curves and both final states.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ort_trainer import ArtifactRunner, ORTTrainer, export_training, optim
from ort_trainer.engine._random import step_seed
from tests.hf_tiny import GPT2, HF_DESC, token_loss
from tests.models import MLP, MLP_DESC, mlp_batches

VOCAB = 64


def optimizers(lr: float = 1e-2) -> dict[str, Callable[[], optim.OptimizerConfig]]:
    """One config of each update rule the artifact writes (Adam in each of its legacy modes)."""
    return {
        "adamw": lambda: optim.AdamConfig(lr=lr, weight_decay=0.01),
        "adam_mode1": lambda: optim.AdamConfig(
            lr=lr, weight_decay=0.01, weight_decay_mode=optim.AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE
        ),
        "adam_no_bias_correction": lambda: optim.AdamConfig(lr=lr, do_bias_correction=False, max_norm_clip=0.5),
        "lamb": lambda: optim.LambConfig(lr=lr, weight_decay=0.01, do_bias_correction=True, ratio_max=5.0),
        "sgd": lambda: optim.SGDConfig(lr=10 * lr),
    }


def mlp_sized_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 8 and of 5 rows, alternating: one graph serves both."""
    return [(x, y) if i % 2 == 0 else (x[:5], y[:5]) for i, (x, y) in enumerate(mlp_batches(steps))]


def gpt2_batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """(input_ids, attention_mask, label) of 4 x 12 and 3 x 7 tokens, alternating."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        batch, seq = (4, 12) if i % 2 == 0 else (3, 7)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append((ids, torch.ones_like(ids), ids.clone()))
    return out


@dataclass
class Case:
    """A model to export: a fresh copy per call of `model`, its description, loss and batches."""

    model: Callable[[], torch.nn.Module]
    desc: dict
    loss_fn: Callable
    batches: Callable[[int], Sequence[tuple[torch.Tensor, ...]]]


def mlp_case() -> Case:
    torch.manual_seed(0)
    model = MLP()
    return Case(lambda: copy.deepcopy(model), MLP_DESC, torch.nn.functional.cross_entropy, mlp_sized_batches)


def gpt2_case(dropout: float = 0.0) -> Case:
    torch.manual_seed(0)
    model = GPT2(layers=2, d_model=32, vocab=VOCAB)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    return Case(lambda: copy.deepcopy(model), HF_DESC, token_loss, gpt2_batches)


def feeds(runner: ArtifactRunner, batch: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in zip(runner.input_names, batch, strict=True)}


def trainer_draws(trainer: ORTTrainer, runner: ArtifactRunner, batch: Sequence[torch.Tensor], step: int) -> dict:
    """The random inputs ORTTrainer draws for its training step ``step`` (1-based), as the artifact takes them: a
    torch generator seeded by (run seed, rank 0, step), one draw per random input in order (`AutogradSession`)."""
    generator = torch.Generator().manual_seed(step_seed(trainer.train_step_info.seed, 0, step))
    sizes = {}
    for entry, value in zip(runner.manifest["inputs"], batch, strict=True):
        for dim, size in zip(entry["shape"], value.shape, strict=True):
            if isinstance(dim, str):
                sizes[dim] = size
    draws = {}
    for entry in runner.manifest["random"]:
        shape = [int(np.prod([int(f) if f.isdigit() else sizes[f] for f in str(d).split("*")])) for d in entry["shape"]]
        tensor = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        tensor.normal_(generator=generator) if entry["kind"] == "normal" else tensor.uniform_(generator=generator)
        draws[entry["name"]] = tensor.numpy()
    return draws


@dataclass
class Runs:
    artifact_losses: list[float]
    trainer_losses: list[float]
    runner: ArtifactRunner
    trainer: ORTTrainer

    def weight_differences(self) -> dict[str, float]:
        """max |artifact - trainer| of every parameter."""
        weights = self.trainer.state_dict()["model"]["full_precision"]
        return {n: float(np.abs(self.runner.state[n] - w.numpy()).max()) for n, w in weights.items()}


def compare_runs(
    case: Case,
    config: Callable[[], optim.OptimizerConfig],
    folder,
    *,
    steps: int = 20,
    options: dict | None = None,
    same_draws: bool = False,
) -> Runs:
    """``steps`` steps of the same model in ORTTrainer and in its artifact (exported from a new trainer)."""
    batches = case.batches(steps)
    export_training(
        case.model(), folder, inputs=batches[0], model_desc=case.desc, optimizer=config(), loss_fn=case.loss_fn,
        options=options,
    )  # fmt: skip
    runner = ArtifactRunner(folder, threads=1)
    trainer = ORTTrainer(case.model(), case.desc, config(), loss_fn=case.loss_fn, options=options)
    artifact, reference = [], []
    for step, batch in enumerate(batches, start=1):
        reference.append(float(trainer.train_step(*batch)))
        scheduler = trainer.options.lr_scheduler
        lr = scheduler.get_last_lr()[0] if scheduler is not None else trainer.optim_config.lr
        draws = trainer_draws(trainer, runner, batch, step) if same_draws else None
        artifact.append(runner.train_step(feeds(runner, batch), lr, random=draws))
    return Runs(artifact, reference, runner, trainer)
