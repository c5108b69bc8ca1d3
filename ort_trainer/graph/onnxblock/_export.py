"""Export a `torch.nn.Module` (+ optional loss) to ONNX and map ONNX initializer names to torch FQNs.

We export a deep copy through a small wrapper (`_forward.ModelWithLoss`: inputs bound to ``forward`` by
name, the loss part of the graph) so the user's model is never touched (tracing in training mode runs a
forward pass that would move BatchNorm statistics). The wrapper prefixes initializer names with
``model.``; the mapping back to the user's FQNs is computed and checked against the torch
``state_dict()``, tied weights included. ``model_desc`` inputs that the exporter drops because
``forward`` never reads them are reported (``ExportedModel.unused_inputs``) and fed to nothing.
The export carries no weights (``export_params=False``): the module's state becomes shell
initializers (name, type, shape; `_weightless`), whose values the trainer holds in its own buffers.
Names are canonical (`_names`): what is traced is the plain module, its DDP / ``torch.compile`` /
checkpoint wrappers removed, and ``get_extra_state`` hidden from the tracer.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import onnx
import torch

from ort_trainer.config.model_desc import ModelDescription

from .._forward import ModelWithLoss, module_for_export
from .._names import outer_module, plain_module
from .._trace_errors import explain_trace_failure
from .._weightless import shell_initializer, strip_data
from ._embedding import check_embedding_modules
from ._no_gradient import UnsupportedBackwardError, seal_no_gradient_copies, traced_gradients
from ._symbolics import register_symbolics
from ._unsupported import explain_unsupported_op

__all__ = ["ExportedModel", "export_torch_model"]

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
    """Trace ``model`` (+ ``loss_fn``) with the TorchScript exporter in training mode.

    ``nn.Embedding`` attributes whose gradient the graph would not give are refused first (`_embedding`).
    """
    check_embedding_modules(model)
    failure: Exception | None = None
    with module_for_export(outer_module(model)) as module, plain_module(module) as plain:
        wrapper = ModelWithLoss(plain, loss_fn, desc)
        wrapper.train()
        try:
            exported = _trace(wrapper, desc, sample_inputs, opset_version, export_params=False)
            if not _inputs_to_shells(exported, plain, desc):  # state the module cannot name: export its values
                exported = _trace(wrapper, desc, sample_inputs, opset_version, export_params=True)
        except Exception as error:  # noqa: BLE001 - explained below (after the module is restored) or re-raised
            failure = error
        else:
            result = ExportedModel(exported, unused_inputs=_unused_inputs(exported, desc))
            _map_names(plain, result)  # while the plain tree (canonical names) is in place
    if isinstance(failure, UnsupportedBackwardError):
        raise failure  # already says what the model does and what to do
    if failure is not None:
        explained = explain_unsupported_op(model, failure) or explain_trace_failure(
            model, loss_fn, desc, sample_inputs, failure
        )
        if explained is None:
            raise failure
        raise explained from failure
    _check_outputs(result.model, desc)
    seal_no_gradient_copies(result.model)
    return result


def _trace(
    wrapper: torch.nn.Module, desc: ModelDescription, sample_inputs, opset_version: int, export_params: bool
) -> onnx.ModelProto:
    buffer = io.BytesIO()
    register_symbolics()  # aten::diff, aten::histc
    # traced_gradients: autograd records (what torch would not differentiate is marked, `_no_gradient`), but the
    # activations it would save for a backward that never runs are dropped, as under no_grad (GPT-2 124M: ~0.3 GiB,
    # 774M: ~1.5 GiB at the export, the build's peak).
    with warnings.catch_warnings(), _shape_inference_without_weight_values(), traced_gradients():
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
            export_params=export_params,
            keep_initializers_as_inputs=False,
            dynamo=False,
        )
    return onnx.load_from_string(buffer.getvalue())


@contextlib.contextmanager
def _shape_inference_without_weight_values() -> Iterator[None]:
    """The TorchScript exporter's whole-graph shape inference, told only shapes of the float weights.

    ``_jit_pass_onnx_graph_shape_type_inference`` (run twice per export) copies every parameter it is
    given into per-node ONNX protos to infer shapes, which no float weight's values ever decide: at
    GPT-2 124M that was 11.6 of the export's 17.8 s. Handing it the non-float constants only (the
    weights stay typed graph inputs, shapes known) gives the same graph (checked on HF GPT-2 and BERT,
    byte for byte) in a third of the time.
    """
    real = torch._C._jit_pass_onnx_graph_shape_type_inference

    def shapes_only(graph, params_dict, opset_version):
        kept = {k: v for k, v in params_dict.items() if not (isinstance(v, torch.Tensor) and v.is_floating_point())}
        return real(graph, kept, opset_version)

    torch._C._jit_pass_onnx_graph_shape_type_inference = shapes_only
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference = real


def _inputs_to_shells(exported: onnx.ModelProto, module: torch.nn.Module, desc: ModelDescription) -> bool:
    """Turn the graph inputs that are the module's state into shell initializers, in place.

    With ``export_params=False`` the exporter makes every state tensor a graph input (named as the
    initializer would be). Returns False, leaving the graph as it is, when an input names no tensor of
    the module's ``state_dict()`` (the caller then exports with the values).
    """
    state = module.state_dict(keep_vars=True)
    user = set(desc.input_names)
    shells = []
    for graph_input in exported.graph.input:
        if graph_input.name in user:
            continue
        fqn = graph_input.name[len(_PREFIX) :] if graph_input.name.startswith(_PREFIX) else None
        tensor = state.get(fqn) if fqn is not None else None
        if not isinstance(tensor, torch.Tensor):
            return False
        elem_type = graph_input.type.tensor_type.elem_type
        shells.append(shell_initializer(graph_input.name, elem_type, tensor.shape))
    kept = [i for i in exported.graph.input if i.name in user]
    del exported.graph.input[:]
    exported.graph.input.extend(kept)
    exported.graph.initializer.extend(shells)
    return True


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
    for init in graph.initializer:  # exported with values (the fallback): the trainer holds them already
        if init.name in result.onnx_to_fqn:
            strip_data(init)
