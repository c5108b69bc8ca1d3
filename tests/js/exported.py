"""Artifacts written by ``ort_trainer.export_training`` for the JS tests and benchmarks: an MLP (AdamW) and a tiny
GPT-2 with Dropout on (AdamW, gradient clipping), with 20-step plans whose batches change size (one graph for all)
and whose random inputs are drawn here, so that every driver is fed the same Dropout masks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import transformers

from ort_trainer import export_training, optim
from tests.hf_tiny import HF_DESC, tiny_gpt2_config, token_loss
from tests.models import MLP, MLP_DESC

STEPS = 20


class DropoutGPT2(torch.nn.Module):
    """tests.hf_tiny's tiny GPT-2 config (2 layers, d 32, vocab 64, 16 positions) with GPT-2's Dropout on (0.1)."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        config = tiny_gpt2_config(dropout=dropout)
        config._attn_implementation = "eager"
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def export_mlp(folder: Path) -> Path:
    torch.manual_seed(0)
    sample = (torch.randn(8, 20), torch.randint(0, 4, (8,)))
    config = optim.AdamConfig(lr=1e-2, weight_decay=0.01)
    return export_training(
        MLP(), folder, inputs=sample, model_desc=MLP_DESC, optimizer=config, loss_fn=torch.nn.functional.cross_entropy
    )


def export_gpt2(folder: Path) -> Path:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 9))
    # three distinct tensors: the export traced one tensor passed twice (ids as input_ids and label) as one input
    sample = [ids[:, :-1].clone(), torch.ones(2, 8, dtype=torch.int64), ids[:, 1:].clone()]
    config = optim.AdamConfig(lr=1e-3, weight_decay=0.01)
    return export_training(
        DropoutGPT2(), folder, inputs=sample, model_desc=HF_DESC, optimizer=config,
        loss_fn=token_loss,
    )  # fmt: skip


def _size(entry: int | str, sizes: dict[str, int]) -> int:
    if isinstance(entry, int):
        return entry
    return math.prod(int(f) if f.isdigit() else sizes[f] for f in entry.split("*"))


def with_draws(manifest: dict, batch: dict[str, np.ndarray], sizes: dict[str, int], rng) -> dict[str, np.ndarray]:
    """``batch`` with a draw for each of the manifest's random inputs (uniform [0, 1) or standard normal)."""
    out = dict(batch)
    for entry in manifest["random"]:
        shape = tuple(_size(d, sizes) for d in entry["shape"])
        draw = rng.random(shape, dtype=np.float32) if entry["kind"] == "uniform" else rng.standard_normal(shape)
        out[entry["name"]] = draw.astype(entry["dtype"])
    return out


def mlp_plan(artifact: Path, steps: int = STEPS, seed: int = 1) -> tuple[list[dict], list[float], dict]:
    """Batches of 8, 5, 3 and 8 rows in turn, a decaying lr, and an eval batch of 6."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(steps):
        n = (8, 5, 3, 8)[i % 4]
        batch = {"x": rng.standard_normal((n, 20)).astype(np.float32), "label": rng.integers(0, 4, n)}
        batches.append(with_draws(manifest, batch, {"batch": n}, rng))
    lrs = [1e-2 * (1 - i / (2 * steps)) for i in range(steps)]
    return batches, lrs, {"x": rng.standard_normal((6, 20)).astype(np.float32), "label": rng.integers(0, 4, 6)}


def _lm_batch(rng, batch: int, seq: int) -> dict[str, np.ndarray]:
    """Token ids, the next tokens as labels; rows after the first padded at the end (mask 0, label -100)."""
    ids = rng.integers(1, 64, (batch, seq + 1))
    mask = np.ones((batch, seq), np.int64)
    labels = ids[:, 1:].copy()
    for row in range(1, batch):
        length = max(1, seq - 2 * row)
        mask[row, length:] = 0
        labels[row, length:] = -100
    return {"input_ids": np.ascontiguousarray(ids[:, :-1]), "attention_mask": mask, "label": labels}


def gpt2_plan(artifact: Path, steps: int = STEPS, seed: int = 1) -> tuple[list[dict], list[float], dict]:
    """Batches of (2, 8), (3, 5), (1, 12) and (2, 16) tokens in turn with padding, Dropout draws, a warmup lr."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(steps):
        batch, seq = ((2, 8), (3, 5), (1, 12), (2, 16))[i % 4]
        batches.append(with_draws(manifest, _lm_batch(rng, batch, seq), {"batch": batch, "seq": seq}, rng))
    lrs = [3e-3 * min(1.0, (i + 1) / 5) for i in range(steps)]
    return batches, lrs, _lm_batch(rng, 2, 10)
