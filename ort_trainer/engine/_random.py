"""Random state of the training graph (Dropout masks) as a pure function of (run seed, rank, step).

ONNX Runtime 1.19's CPU ``Dropout`` (like ``RandomUniform`` and friends) draws each run's mask from a
``std::default_random_engine`` seeded with ``RandomGenerator::Default().NextSeed()``: a process-wide
counter that ``onnxruntime.set_seed(s)`` resets to ``s`` and every random node advances by one, in
execution order. Nothing of it can be read back, so it cannot go into a checkpoint. Instead, before
every training run the counter is reset to :func:`step_seed` ``(run_seed, rank, step)``: step ``n``'s
masks are the same whether the run got there in one go or through a save and a load in a new process,
as long as the run seed (stored in ``train_step_info``) and the step counter are restored. A node with
its own ``seed`` attribute keeps its own generator (torch never exports one).

Ranks: the run seed is rank 0's, agreed at construction; the rank is hashed into each step's seed, so
data-parallel (and ZeRO) ranks draw independent masks for their different samples, as independent
batches would, and the same masks again when the run resumes on the same number of ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import onnx
import onnxruntime as ort
import torch

__all__ = ["RANDOM_OPS", "agreed_run_seed", "as_run_seed", "draws_randomness", "reseed", "step_seed"]

# ops whose kernels take their seed from ONNX Runtime's default generator when they have no `seed` attribute
RANDOM_OPS = frozenset(
    {"Dropout", "BitmaskDropout", "BiasDropout", "RandomUniform", "RandomUniformLike", "RandomNormal",
     "RandomNormalLike", "Bernoulli", "Multinomial"}
)  # fmt: skip
_INT63 = (1 << 63) - 1


def draws_randomness(model: onnx.ModelProto) -> bool:
    """Whether any node of ``model`` (subgraphs included) draws from ONNX Runtime's default generator."""
    return _draws(model.graph)


def _draws(graph: onnx.GraphProto) -> bool:
    for node in graph.node:
        if node.op_type in RANDOM_OPS and not any(a.name == "seed" for a in node.attribute):
            return True
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            if any(_draws(g) for g in subgraphs):
                return True
    return False


def step_seed(run_seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for training step ``step`` (1-based) on ``rank``; consecutive steps get unrelated seeds.

    Hashed rather than ``run_seed + step``: each random node takes the next value of the counter, so
    additive seeds would give step ``n``'s second Dropout step ``n + 1``'s first mask.
    """
    digest = hashlib.blake2b(f"{run_seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _INT63


def reseed(run_seed: int, rank: int, step: int) -> None:
    """Reset ONNX Runtime's default generator for ``step`` (right before that step's training run)."""
    ort.set_seed(step_seed(run_seed, rank, step))


def as_run_seed(value: int) -> int:
    """Any int (``torch.initial_seed()`` is 64-bit unsigned) as a seed that HDF5 stores as int64 >= 0."""
    return int(value) & _INT63


def agreed_run_seed(dist: Any = None) -> int:
    """A new run's seed: ``torch.initial_seed()`` (so ``torch.manual_seed(s)`` makes Dropout repeatable too),
    rank 0's on every rank (``dist``: the trainer's `DistributedContext`, or None). A loaded checkpoint's
    ``train_step_info.seed`` replaces it."""
    seed = as_run_seed(torch.initial_seed())
    return seed if dist is None else int(dist.all_gather_objects(seed)[0])
