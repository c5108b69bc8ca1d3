"""What a module must not do for either engine's graph, refused before any trace (naming the submodule)."""

from __future__ import annotations

import torch

__all__ = ["refuse_max_norm"]


def refuse_max_norm(model: torch.nn.Module) -> None:
    """Refuse ``nn.Embedding(max_norm=...)`` (both engines): the forward writes the weight, which a graph cannot."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
            raise ValueError(
                f"{name or 'the model'} ({type(module).__name__}) has max_norm={module.max_norm}: torch renormalises "
                "the rows it looks up in the weight itself, in place, on every forward pass, which a training graph "
                "cannot do; build the embedding with max_norm=None (renormalise the weight yourself between steps "
                "if you need it)"
            )
