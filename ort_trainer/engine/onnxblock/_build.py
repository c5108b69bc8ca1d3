"""`build_onnxblock_engine`: the onnxblock engine's `Engine` (onnxruntime-training's gradient builder).

Runs once, on the first `train_step`/`eval_step` (the exporter needs real inputs to trace). The order:
export -> graph passes -> onnxblock -> session over the `ParamStore` buffers the trainer made
at construction (the graph uses a subset of them: unused parameters are never updated). The graphs
carry the state as shapes only (`graph._weightless`): the values are in the store, nowhere else.
Each phase is logged with its duration (`engine._progress`); the eval session is created on the first
eval step (`_session`). With Megatron (``horizontal_parallel_size > 1``), the plan's segment sessions
(`parallel`) take the training session's place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import onnx
import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.diagnosis import find_label_inputs
from ort_trainer.graph import (
    copy_without_data,
    model_op_types,
    onnx_model_parameters,
    provider_fp16_support,
    strip_data,
    with_values,
)
from ort_trainer.graph.onnxblock import (
    add_optional_outputs,
    apply_forward_rewrites,
    apply_training_rewrites,
    convert_to_mixed_precision,
    expand_where_inputs,
    export_torch_model,
    strip_loss_scaling,
    surface_batchnorm_statistics,
    unfuse_scaled_sum,
)
from ort_trainer.runtime import release_freed_memory

from .._build import BuildRequest, Engine, engine_for, save_debug_graph
from .._progress import BuildProgress
from .._store import graph_state_names
from ._session import TrainingSession

__all__ = ["build_onnxblock_engine"]


def build_onnxblock_engine(request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
    """Export, graph passes, gradient graph, training session: each phase logged with its duration."""
    progress = BuildProgress(5, "ORTTrainer build")
    store = request.store
    with progress.phase("export"):
        forward, graph_names, unused = _forward_model(request, sample_inputs)
    with progress.phase("forward graph passes"):
        forward, trainable, frozen, bn_stats, label_specs = _prepare_forward(request, forward, graph_names)
    if request.horizontal is not None:
        with progress.phase("Megatron segment sessions"):
            engine = _horizontal_engine(request, forward, trainable, frozen, sample_inputs, unused, label_specs)
        progress.close()
        return engine
    with progress.phase("gradient graph"):
        train_model, eval_model, loss_scale_input = _training_graphs(request, forward, trainable, frozen)
        # No optimizer runs inside any graph (it runs in PyTorch over the flat buffers): the "training graph"
        # that ONNX Runtime runs is the gradient graph, so both debug paths receive it (docs/migrating.md).
        save_debug_graph(request, "model_with_gradient_graph_path", train_model)
        save_debug_graph(request, "model_with_training_graph_path", train_model)
    used = set(trainable)
    store.optimizer.set_idle([name for name in store.layout.names if name not in used])
    with progress.phase("training session"):
        session = TrainingSession(
            train_model,
            eval_model,
            {name: store.param_views[name] for name in trainable},
            {name: store.grad_views[name] for name in trainable},
            {name: store.frozen[name] for name in frozen},
            bn_stats,
            request.desc.output_names,
            request.device,
            request.session_options,
            request.shrink_arena,
        )
    del train_model, forward
    with progress.phase("free build memory"):
        release_freed_memory()  # export/gradient-building scratch, which glibc would otherwise keep resident
    progress.close()
    return engine_for(
        request,
        session,
        sample_inputs,
        loss_scale_input=loss_scale_input,
        unused_inputs=unused,
        label_specs=label_specs,
        output_types={o.name: o.type.tensor_type.elem_type for o in eval_model.graph.output},
        tracks_batches=bool(bn_stats),
    )


def _prepare_forward(request: BuildRequest, forward: onnx.ModelProto, graph_names: dict[str, str]):
    """The forward graph's passes: user postprocess, CPU rewrites, BatchNorm statistics, optional outputs."""
    store = request.store
    values = {onnx_name: store.weights[name] for onnx_name, name in graph_names.items() if name in store.weights}
    forward = _postprocess(request, forward, values)
    present = {init.name for init in forward.graph.initializer}
    graph_names = {onnx_name: name for onnx_name, name in graph_names.items() if onnx_name in present}
    label_specs = find_label_inputs(forward, request.desc.input_names)
    if request.device.torch_device.type == "cpu":  # rewrites of slow CPU gradient kernels; CUDA left as is
        apply_forward_rewrites(forward)
    bn_stats = surface_batchnorm_statistics(forward)
    add_optional_outputs(forward)
    save_debug_graph(request, "model_after_graph_transforms_path", forward, values)
    trainable, frozen = graph_state_names(store, graph_names)
    if not trainable:
        raise ValueError(
            f"the exported graph uses none of the trainable parameters {list(store.layout.names)}; "
            "check that the loss depends on them"
        )
    expand_where_inputs(forward, set(trainable))  # ORT's Where gradient ignores broadcasting
    return forward, trainable, sorted(frozen), bn_stats, label_specs


def _horizontal_engine(request, forward, trainable, frozen, sample_inputs, unused, label_specs) -> Engine:
    """Megatron: the graph cut into segments with collectives between them (`parallel`)."""
    store = request.store
    store.optimizer.set_idle([name for name in store.layout.names if name not in set(trainable)])
    session = request.horizontal.build_session(forward, trainable, sorted(frozen), store, request)
    release_freed_memory()
    return engine_for(
        request,
        session,
        sample_inputs,
        unused_inputs=unused,
        label_specs=label_specs,
    )


def _training_graphs(request: BuildRequest, forward: onnx.ModelProto, trainable: list[str], frozen: list[str]):
    """Training + eval graphs; with mixed precision, fp16 where the provider supports it and a scaled loss."""
    backprop, loss_scale_input, mixed = [], None, None
    if request.mixed_precision:
        support = provider_fp16_support(request.device.providers, model_op_types(forward))
        loss_name = request.desc.output_names[request.desc.loss_index]
        mixed = convert_to_mixed_precision(
            forward, trainable=trainable, frozen=frozen, loss_output=loss_name, support=support
        )
        forward, backprop, loss_scale_input = mixed.model, [mixed.backprop_output], mixed.loss_scale_input
    known = set(request.desc.output_names) | set(backprop)
    outputs = backprop + _loss_first(request.desc) + [o.name for o in forward.graph.output if o.name not in known]
    from ._graphs import build_training_graphs  # onnxruntime-training: imported only where the graph is built

    train_model, eval_model = build_training_graphs(forward, trainable, frozen, outputs)
    if request.device.torch_device.type == "cpu":  # slow single-threaded gradient kernels; CUDA left as is
        unfuse_scaled_sum(train_model)  # the gradient builder's CUDA-only fusion: no CPU kernel
        apply_training_rewrites(train_model, request.session_options.intra_op_num_threads or (os.cpu_count() or 1))
    if mixed is not None:
        strip_loss_scaling(eval_model, mixed)
    return train_model, eval_model, loss_scale_input


def _forward_model(request: BuildRequest, sample_inputs) -> tuple[onnx.ModelProto, dict[str, str], tuple[str, ...]]:
    """The forward ONNX graph (state as shell initializers), ``{initializer: state name}``, unused inputs."""
    if isinstance(request.model, onnx.ModelProto):
        names = onnx_model_parameters(request.model)
        return copy_without_data(request.model, names), {n: n for n in names}, ()
    exported = export_torch_model(request.model, request.loss_fn, request.desc, sample_inputs, request.opset_version)
    return exported.model, dict(exported.onnx_to_fqn), exported.unused_inputs


def _postprocess(request: BuildRequest, forward: onnx.ModelProto, values) -> onnx.ModelProto:
    """``_internal_use.extra_postprocess(model) -> model``: the user's last word on the forward graph (legacy).

    It gets a complete model (the state's current values filled in), as the legacy trainer gave it;
    the state's data is dropped again from what it returns (the trainer's buffers hold the values).
    """
    if request.extra_postprocess is None:
        return forward
    result = request.extra_postprocess(with_values(forward, values))
    if not isinstance(result, onnx.ModelProto):
        raise TypeError(
            f"options._internal_use.extra_postprocess must return an onnx.ModelProto, got {type(result).__name__}"
        )
    for init in result.graph.initializer:
        if init.name in values:
            strip_data(init)
    return result


def _loss_first(desc: ModelDescription) -> list[str]:
    names = list(desc.output_names)
    loss = names.pop(desc.loss_index)
    return [loss, *names]
