"""Builders the tests share: the MLP trainer most tests train, and the legacy ``trainer_options`` record.

Importable by test modules and spawned worker scripts alike (``from tests.builders import ...``);
``tests/conftest.py`` offers the legacy record as the ``trainer_options`` fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.checkpoint import TrainerOptionsRecord
from tests.models import MLP, MLP_DESC

ce = torch.nn.functional.cross_entropy
# the legacy record of a one-process Adam run (the format's own record, so the keys cannot drift)
ONE_PROCESS_ADAM = TrainerOptionsRecord(
    mixed_precision=False,
    zero_stage=0,
    world_rank=0,
    world_size=1,
    optimizer_name="AdamOptimizer",
    data_parallel_size=1,
    horizontal_parallel_size=1,
)


def legacy_trainer_options(**changes: Any) -> dict[str, Any]:
    """The ``trainer_options`` section of a legacy checkpoint: one process, Adam, no ZeRO, fp32 (+ ``changes``)."""
    options = ONE_PROCESS_ADAM.to_tree()
    unknown = set(changes) - set(options)
    if unknown:
        raise KeyError(f"not a trainer_options key: {sorted(unknown)}")
    return {**options, **changes}


def mlp_trainer(
    model: torch.nn.Module | None = None,
    *,
    config: optim.config.OptimizerConfig | None = None,
    desc: Any = MLP_DESC,
    loss_fn: Callable | None = ce,
    seed: int | None = 0,
    hidden: int = 16,
    **options: Any,
) -> ORTTrainer:
    """An ``ORTTrainer`` over ``model`` (default: ``MLP(hidden)`` built after seeding torch with ``seed``),
    Adam(lr=0.01) unless ``config`` is given, cross entropy; ``options``: sections of the legacy options dict.
    ``seed=None`` leaves torch's generator alone."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model if model is not None else MLP(hidden=hidden)
    config = config if config is not None else optim.AdamConfig(lr=0.01)
    return ORTTrainer(model, desc, config, loss_fn=loss_fn, options=options or None)


def sgd_trainer(model: torch.nn.Module | None = None, desc: Any = MLP_DESC, loss_fn: Callable | None = ce, **options):
    """`mlp_trainer` with SGD(lr=0.1) and without seeding (the model is usually given)."""
    return mlp_trainer(model, config=optim.SGDConfig(lr=0.1), desc=desc, loss_fn=loss_fn, seed=None, **options)


def assert_steps_match_torch_sgd(
    trainer: ORTTrainer, reference: torch.nn.Module, batches, loss_fn: Callable = ce, lr: float = 0.1
) -> None:
    """Train ``trainer`` and ``reference`` (plain ``torch.optim.SGD``) in lockstep; every loss must agree."""
    opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for *inputs, label in batches:
        got = trainer.train_step(*inputs, label)
        opt.zero_grad()
        expected = loss_fn(reference(*inputs), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)
