"""The training-step graph: the autograd engine's forward + backward, then clipping and the optimizer update.

The exported training graph returns the loss and every trained parameter's gradient (``<name>_grad``); this
module turns the gradients into updated state: new weights and moments as outputs (``<state name>.new``), the
gradients no longer outputs. Inputs are put in the manifest's order: state the graph reads, batch inputs,
``lr``, ``step``, random draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from ort_trainer.graph.autograd import GRAD_SUFFIX, UPDATED_SUFFIX
from ort_trainer.optim.config import OptimizerConfig

from . import _updates
from ._builder import GraphBuilder

__all__ = ["LR", "NEW_SUFFIX", "STEP", "StepGraph", "add_update", "moment_names"]

LR, STEP = "lr", "step"
NEW_SUFFIX = ".new"
GRAD_NORM = "grad_norm"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def moment_names(parameter: str) -> tuple[str, str]:
    """The state names of a parameter's first and second moments."""
    return tuple(f"optimizer.{parameter}.{key}" for key in _MOMENTS)  # type: ignore[return-value]


@dataclass
class StepGraph:
    """What the manifest says of the finished training graph."""

    inputs: list[str]
    updated: dict[str, str]  # state name -> output name
    extra_outputs: list[str] = field(default_factory=list)


def add_update(
    model: onnx.ModelProto,
    *,
    config: OptimizerConfig,
    trained: Sequence[str],
    updated_buffers: Sequence[str],
    state_shapes: Mapping[str, Sequence[int]],
    batch_inputs: Sequence[str],
    random_inputs: Sequence[str],
    loss: str,
    clip: bool,
) -> StepGraph:
    """Append clipping and the update of ``config`` to the training graph ``model`` (in place)."""
    graph = model.graph
    b = GraphBuilder(graph)
    present = {i.name: i for i in graph.input}
    grads = {name: name + GRAD_SUFFIX for name in trained}
    moments = config.name != "SGDOptimizer"
    new_inputs = [
        helper.make_tensor_value_info(LR, TensorProto.FLOAT, []),
        helper.make_tensor_value_info(STEP, TensorProto.INT64, []),
    ]
    optimizer_inputs = []
    if moments:
        for name in trained:
            for moment in moment_names(name):
                optimizer_inputs.append(
                    helper.make_tensor_value_info(moment, TensorProto.FLOAT, list(state_shapes[name]))
                )
    s = _updates.scalars(b, LR, STEP)
    extra = []
    if clip and moments:
        limits = {name: config.hyper_parameters(name)["max_norm_clip"] for name in trained}
        grads, norm = _updates.clip_gradients(b, grads, limits)
        b.rename(norm, GRAD_NORM)
        extra.append(GRAD_NORM)
    updated: dict[str, str] = {}
    for name in trained:
        if config.name == "SGDOptimizer":
            b.rename(_updates.sgd(b, s, name, grads[name]), name + NEW_SUFFIX)
            updated[name] = name + NEW_SUFFIX
            continue
        m, v = moment_names(name)
        rule = _updates.adam if config.name == "AdamOptimizer" else _updates.lamb
        values = rule(b, config.hyper_parameters(name), s, name, grads[name], m, v)
        for state, value in zip((name, m, v), values, strict=True):
            b.rename(value, state + NEW_SUFFIX)
            updated[state] = state + NEW_SUFFIX
    for buffer in updated_buffers:
        updated[buffer] = buffer + UPDATED_SUFFIX
    old_outputs = {o.name: o for o in graph.output}
    outputs = [old_outputs[loss]]
    outputs += [_float_value(out, state_shapes[state]) for state, out in updated.items() if out.endswith(NEW_SUFFIX)]
    outputs += [old_outputs[name] for state, name in updated.items() if not name.endswith(NEW_SUFFIX)]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, []) for name in extra]
    del graph.output[:]
    graph.output.extend(outputs)
    state = [present[n] for n in present if n not in batch_inputs and n not in random_inputs]
    ordered = state + optimizer_inputs + [present[n] for n in batch_inputs if n in present] + new_inputs
    ordered += [present[n] for n in random_inputs if n in present]
    del graph.input[:]
    graph.input.extend(ordered)
    return StepGraph([i.name for i in ordered], updated, extra)


def _float_value(name: str, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
