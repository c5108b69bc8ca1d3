"""``torch``, imported on first use: the checkpoint tool's read-only commands never load it.

``inspect``, ``verify`` and ``diff`` of our files work on numpy and h5py alone, so they start in a
fraction of torch's import time. Modules of this package write ``from ..format.lazy_torch import torch``
and use ``torch.X`` as usual: the first attribute access imports torch. :func:`loaded` says whether
anything imported torch yet: a value cannot be a tensor before that (``is_tensor`` checks no further).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

__all__ = ["is_tensor", "is_torch_dtype", "loaded", "torch"]


class _LazyTorch(ModuleType):
    """Stands for the ``torch`` module; resolves it on the first attribute access."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch"), name)


torch: Any = _LazyTorch("torch")


def loaded() -> bool:
    """True once torch has been imported in this process (by us or anyone)."""
    return "torch" in sys.modules


def is_tensor(value: Any) -> bool:
    """``isinstance(value, torch.Tensor)`` without importing torch (no tensor exists before it is)."""
    return loaded() and isinstance(value, sys.modules["torch"].Tensor)


def is_torch_dtype(value: Any) -> bool:
    """``isinstance(value, torch.dtype)`` without importing torch."""
    return loaded() and isinstance(value, sys.modules["torch"].dtype)
