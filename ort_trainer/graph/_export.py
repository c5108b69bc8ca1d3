"""Export a `torch.nn.Module` (+ optional loss) to ONNX and map ONNX initializer names to torch FQNs.

We export a deep copy through a small wrapper (`_forward.ModelWithLoss`: inputs bound to ``forward`` by
name, the loss part of the graph) so the user's model is never touched (tracing in training mode runs a
forward pass that would move BatchNorm statistics). The wrapper prefixes initializer names with
``model.``; the mapping back to the user's FQNs is computed and checked against the torch
``state_dict()``, tied weights included. ``model_desc`` inputs that the exporter drops because
``forward`` never reads them are reported (``ExportedModel.unused_inputs``) and fed to nothing.
Names are canonical (`_names`): what is traced is the plain module, its DDP / ``torch.compile`` /
checkpoint wrappers removed, and ``get_extra_state`` hidden from the tracer.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx
import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.diagnosis._input_checks import explain_trace_failure
from ort_trainer.graph._names import outer_module, plain_module

from ._forward import ModelWithLoss, module_for_export
from ._symbolics import register_symbolics
from ._unsupported import explain_unsupported_op

__all__ = ["ExportedModel", "export_torch_model", "onnx_model_parameters"]

_PREFIX = "model."


@dataclass
class ExportedModel:
    """An ONNX forward graph plus what ties it back to the torch module."""

    model: onnx.ModelProto
    onnx_to_fqn: dict[str, str] = field(default_factory=dict)  # ONNX initializer -> torch FQN
    fqn_to_onnx: dict[str, str] = field(default_factory=dict)  # every float torch FQN (tied too) -> ONNX name
    buffers: set[str] = field(default_factory=set)  # ONNX names that are torch buffers (never trained)
    no_grad: set[str] = field(default_factory=set)  # ONNX names of parameters with requires_grad=False
    unused_inputs: tuple[str, ...] = ()  # model_desc inputs forward() never reads (not graph inputs)


def export_torch_model(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    desc: ModelDescription,
    sample_inputs: Sequence[torch.Tensor],
    opset_version: int,
) -> ExportedModel:
    """Trace ``model`` (+ ``loss_fn``) with the TorchScript exporter in training mode."""
    failure: Exception | None = None
    with module_for_export(outer_module(model)) as module, plain_module(module) as plain:
        wrapper = ModelWithLoss(plain, loss_fn, desc)
        wrapper.train()
        try:
            exported = _trace(wrapper, desc, sample_inputs, opset_version)
        except Exception as error:  # noqa: BLE001 - explained below (after the module is restored) or re-raised
            failure = error
        else:
            result = ExportedModel(exported, unused_inputs=_unused_inputs(exported, desc))
            _map_names(plain, result)  # while the plain tree (canonical names) is in place
    if failure is not None:
        explained = explain_unsupported_op(model, failure) or explain_trace_failure(
            model, loss_fn, desc, sample_inputs, failure
        )
        if explained is None:
            raise failure
        raise explained from failure
    _check_outputs(result.model, desc)
    return result


def _trace(wrapper: torch.nn.Module, desc: ModelDescription, sample_inputs, opset_version: int) -> onnx.ModelProto:
    buffer = io.BytesIO()
    register_symbolics()  # aten::diff, aten::histc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            tuple(sample_inputs),
            buffer,
            input_names=list(desc.input_names),
            output_names=list(desc.output_names),
            dynamic_axes=desc.dynamic_axes(),
            opset_version=opset_version,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            export_params=True,
            keep_initializers_as_inputs=False,
            dynamo=False,
        )
    return onnx.load_from_string(buffer.getvalue())


def _unused_inputs(exported: onnx.ModelProto, desc: ModelDescription) -> tuple[str, ...]:
    """``model_desc`` inputs the exporter dropped (forward never reads them): warned about, then ignored."""
    graph_inputs = {i.name for i in exported.graph.input}
    unused = tuple(n for n in desc.input_names if n not in graph_inputs)
    if unused:
        warnings.warn(
            f"model_desc inputs {list(unused)} are not used by the model (the exporter dropped them from the "
            "graph); train_step and eval_step still accept them and ignore them",
            UserWarning,
            stacklevel=5,
        )
    return unused


def onnx_model_parameters(model: onnx.ModelProto) -> list[str]:
    """Float initializers of a user-given ONNX model: its parameters (everything else is a constant)."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
    return [init.name for init in model.graph.initializer if init.data_type in floats]


def _check_outputs(exported: onnx.ModelProto, desc: ModelDescription) -> None:
    got = [out.name for out in exported.graph.output]
    if got != list(desc.output_names):
        raise ValueError(
            f"the exported model has outputs {got}, but model_desc declares {list(desc.output_names)}; "
            "the model (with loss_fn: the loss followed by the model's predictions) must return exactly "
            "the outputs listed in model_desc['outputs'], in that order"
        )


def _map_names(model: torch.nn.Module, result: ExportedModel) -> None:
    """Fill the ONNX <-> FQN maps by matching initializer names to the (plain) module's state-dict keys.

    A tensor reachable under several names (tied weights) is named after its first name in
    ``named_parameters()`` order (buffers: ``state_dict()`` order), as `_store.model_state` names it.
    """
    state = model.state_dict(keep_vars=True)
    param_names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    aliases: dict[int, list[str]] = {}
    for fqn in param_names + list(state):
        tensor = model.get_parameter(fqn) if fqn not in state else state[fqn]
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and fqn not in aliases.get(id(tensor), []):
            aliases.setdefault(id(tensor), []).append(fqn)
    for init in result.model.graph.initializer:
        fqn = init.name[len(_PREFIX) :] if init.name.startswith(_PREFIX) else None
        if fqn is None or fqn not in state:
            continue  # an exporter-made constant, not model state
        names = aliases.get(id(state[fqn]), [fqn])
        result.onnx_to_fqn[init.name] = names[0]
        for alias in names:
            result.fqn_to_onnx[alias] = init.name
        if fqn not in param_names:
            result.buffers.add(init.name)
        elif not state[fqn].requires_grad:
            result.no_grad.add(init.name)
    _rename_initializers(result)


def _rename_initializers(result: ExportedModel) -> None:
    """Drop the wrapper's ``model.`` prefix so ONNX names equal the user's torch FQNs."""
    renames = {old: fqn for old, fqn in result.onnx_to_fqn.items()}
    taken = {init.name for init in result.model.graph.initializer} | {i.name for i in result.model.graph.input}
    for old, new in renames.items():
        if new in taken and new != old:
            raise ValueError(f"cannot rename ONNX initializer {old!r} to {new!r}: that name is already used")
    graph = result.model.graph
    for init in graph.initializer:
        init.name = renames.get(init.name, init.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    result.onnx_to_fqn = {new: new for new in renames.values()}
    result.fqn_to_onnx = {fqn: renames[onnx_name] for fqn, onnx_name in result.fqn_to_onnx.items()}
    result.buffers = {renames[n] for n in result.buffers}
    result.no_grad = {renames[n] for n in result.no_grad}
