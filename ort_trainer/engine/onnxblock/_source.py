"""`SOURCE`: the onnxblock engine as a `GraphSource` (``utils.engine="onnxblock"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._build import BuildRequest, Engine
from .._protocols import ModelParallelFactory
from ._build import build_onnxblock_engine

__all__ = ["SOURCE"]


class _OnnxblockSource:
    """The TorchScript export and onnxruntime-training's gradient builder; Megatron's plan runs on it."""

    name = "onnxblock"

    def check_supported(self, model: Any, options: Any, desc: Any) -> None:
        """ValueError for what this engine's graphs cannot be (a bfloat16 graph: its graphs are float16)."""
        dtype = options.mixed_precision.dtype
        if options.mixed_precision.enabled and dtype != "float16":
            raise ValueError(
                f"mixed_precision.dtype={dtype!r} needs the autograd engine (the onnxblock "
                "engine's graphs are float16): use options={'utils': {'engine': 'autograd'}} or dtype 'float16'"
            )

    def model_parallel(self) -> ModelParallelFactory:
        from .parallel import HorizontalParallel  # Megatron: loaded only when asked for

        return HorizontalParallel

    def build(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
        return build_onnxblock_engine(request, sample_inputs)


SOURCE = _OnnxblockSource()
