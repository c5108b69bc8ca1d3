"""`SOURCE`: the autograd engine as a `GraphSource` (``utils.engine="autograd"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._build import BuildRequest, Engine
from ._build import build_autograd_engine, check_autograd_supported

__all__ = ["SOURCE"]


class _AutogradSource:
    """PyTorch's autograd traced and exported; no model-parallel plan (Megatron needs the onnxblock engine)."""

    name = "autograd"

    def check_supported(self, model: Any, options: Any, desc: Any) -> None:
        check_autograd_supported(model, options, desc)

    def model_parallel(self) -> None:
        return None

    def build(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
        return build_autograd_engine(request, sample_inputs)


SOURCE = _AutogradSource()
