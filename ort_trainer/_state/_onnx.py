"""The eval graph with the trained weights (``save_as_onnx``) and the export self-check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import onnx
import torch
from onnx import numpy_helper

from ort_trainer.engine import TrainerState
from ort_trainer.graph import with_values

if TYPE_CHECKING:
    from ort_trainer.engine import Engine

__all__ = ["check_model_export", "eval_model_with_weights"]


def eval_model_with_weights(engine: Engine) -> onnx.ModelProto:
    """The eval graph with current parameters and frozen state moved back into initializers, for any
    ``onnxruntime`` (`Engine.eval_graph`: the onnxblock engine's stop-gradient copies become ``Identity``)."""
    model = engine.eval_graph()
    inputs = {i.name for i in model.graph.input}
    state = {name: tensor for name, tensor in engine.store.weights.items() if name in inputs}
    kept = [i for i in model.graph.input if i.name not in state]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for name, tensor in state.items():
        model.graph.initializer.append(numpy_helper.from_array(tensor.detach().cpu().numpy(), name))
    return with_values(model, engine.store.weights)  # state kept as shell initializers (a Megatron eval graph)


def check_model_export(trainer: TrainerState, inputs: Sequence[torch.Tensor]) -> None:
    """Compare the torch module's eval-mode outputs with the exported eval graph (rtol 1e-2, atol 1e-6)."""
    if not isinstance(trainer.model, torch.nn.Module):
        return
    from ort_trainer.graph import eval_outputs

    from ..graph import outer_module

    desc = trainer.model_desc
    expected = eval_outputs(outer_module(trainer.model), trainer.loss_fn, desc, inputs)
    got = trainer.engine.session.run_eval(dict(zip(desc.input_names, inputs, strict=True)))
    for name, want in zip(desc.output_names, expected, strict=False):
        if not torch.allclose(got[name].cpu().to(want.dtype), want.cpu(), rtol=1e-2, atol=1e-6):
            diff = (got[name].cpu().to(want.dtype) - want.cpu()).abs().max().item()
            raise RuntimeError(f"debug.check_model_export: ONNX output {name!r} differs from PyTorch by {diff:g}")
