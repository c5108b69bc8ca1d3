"""The optimizer as Hugging Face sees it, and the AdamW config ONNX Runtime runs.

HF's loop owns a ``torch.optim.Optimizer``: its LR scheduler writes the rate into ``param_groups`` and
its loop calls ``step()``. `OptimizerView` is that object, over the model's real parameters with HF's
two groups (decay / no decay), but the update itself runs inside ORTTrainer's ``train_step`` (on the
last micro-batch of an accumulation cycle), with the rate read from these ``param_groups``; ``step()``
has nothing left to do. `adam_config` turns the same arguments and groups into an ``optim.AdamConfig``
equal to ``torch.optim.AdamW`` (``DecayMode.BEFORE_WEIGHT_UPDATE``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ort_trainer import optim

__all__ = ["GroupRates", "OptimizerView", "adam_config", "parameter_groups"]


def parameter_groups(model: torch.nn.Module, decay_names: Iterable[str], weight_decay: float) -> list[dict]:
    """HF's grouping (``Trainer.create_optimizer``): trainable parameters with and without weight decay."""
    decay = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "names": [n for n, _ in named if n in decay],
         "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "names": [n for n, _ in named if n not in decay],
         "weight_decay": 0.0},
    ]  # fmt: skip


class OptimizerView(torch.optim.Optimizer):
    """HF's handle on the optimizer: groups and rates for HF's scheduler; the update runs in ONNX Runtime."""

    def __init__(self, groups: Sequence[dict], *, lr: float, betas: tuple[float, float], eps: float):
        super().__init__([dict(g) for g in groups if g["params"]], {"lr": lr, "betas": betas, "eps": eps})

    def step(self, closure: Any = None) -> None:
        """Nothing to do: ORTTrainer already updated the weights on the cycle's last ``train_step``."""
        if closure is not None:
            raise ValueError("ort_trainer.hf: optimizer.step(closure) is not supported; the update runs in ORT")

    def learning_rate(self) -> float:
        """The one rate ONNX Runtime trains with (HF's schedulers scale every group alike)."""
        rates = {float(g["lr"]) for g in self.param_groups}
        if len(rates) != 1:
            raise ValueError(
                f"ort_trainer.hf: the parameter groups have different learning rates {sorted(rates)}; "
                "ONNX Runtime trains with one rate"
            )
        return rates.pop()


class GroupRates:
    """The groups' current rates as a checkpoint ``stateful`` (HF's scheduler state does not hold them)."""

    def __init__(self, view: OptimizerView):
        self._view = view

    def state_dict(self) -> dict[str, list[float]]:
        return {"lr": [float(g["lr"]) for g in self._view.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        rates = [float(x) for x in state["lr"]]
        if len(rates) != len(self._view.param_groups):
            raise ValueError(
                f"checkpoint holds {len(rates)} parameter-group rates, this optimizer has "
                f"{len(self._view.param_groups)} groups"
            )
        for group, rate in zip(self._view.param_groups, rates, strict=True):
            group["lr"] = rate


def adam_config(args: Any, groups: Sequence[dict], prefix: str) -> optim.AdamConfig:
    """``optim.AdamConfig`` equal to HF's default ``torch.optim.AdamW`` for these arguments and groups.

    ``prefix`` is where the model sits in the module ORTTrainer trains (its parameter names).
    """
    no_decay = [prefix + n for g in groups if g["weight_decay"] == 0.0 for n in g["names"]]
    params = [{"params": no_decay, "lambda_coef": 0.0}] if no_decay and args.weight_decay else []
    return optim.AdamConfig(
        params=params,
        lr=args.learning_rate,
        alpha=args.adam_beta1,
        beta=args.adam_beta2,
        lambda_coef=args.weight_decay,
        epsilon=args.adam_epsilon,
        max_norm_clip=args.max_grad_norm if args.max_grad_norm > 0 else 1.0,
        weight_decay_mode=optim.AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE,
    )
