"""The onnxblock engine's graph source: ONNX Runtime's C++ gradient builder (``onnxruntime-training``).

Imported only when that engine builds, so that the rest of the engine works on the stock ``onnxruntime``.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnxruntime.training import onnxblock

from ort_trainer.graph import shells_to_inputs
from ort_trainer.graph.onnxblock import forget_unnamed_dims
from ort_trainer.runtime import quiet_native_info_logs

__all__ = ["build_training_graphs"]


class _ExistingLoss(onnxblock.TrainingBlock):
    """A training block whose loss is already a graph output: backprop starts from it."""

    def build(self, *output_names: str) -> list[str]:
        return list(output_names)

    def infer_shapes_on_base(self) -> onnx.ModelProto:
        """onnxblock's shape inference, with the dims it could not infer left unknown (`_gradient_fixes`)."""
        return forget_unnamed_dims(super().infer_shapes_on_base())


def build_training_graphs(
    forward: onnx.ModelProto, trainable: Sequence[str], frozen: Sequence[str], outputs: Sequence[str]
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Gradient graph (with in-place gradient accumulation) and eval graph; ``outputs[0]`` is the loss."""
    shells_to_inputs(forward, [*trainable, *frozen])  # state as graph inputs before onnxblock copies the graph
    block = _ExistingLoss()
    for name in trainable:
        block.requires_grad(name, True)
    for name in frozen:
        block.requires_grad(name, False)
    with quiet_native_info_logs(), onnxblock.base(forward):
        block(*outputs)
    return block.to_model_proto()
