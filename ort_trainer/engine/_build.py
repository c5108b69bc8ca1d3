"""Turn a torch module or ONNX model into a ready `Engine`: graphs, flat buffers, optimizer, session.

Runs once, on the first `train_step`/`eval_step` (the exporter needs real inputs to trace).
`_sources.build_engine` hands the request to the graph source the trainer chose: the autograd
engine (`_autograd_build`) or the onnxblock engine, whose build is this module's. The onnxblock order:
export -> graph passes -> onnxblock -> session over the `ParamStore` buffers the trainer made
at construction (the graph uses a subset of them: unused parameters are never updated). The graphs
carry the state as shapes only (`graph._weightless`): the values are in the store, nowhere else.
Each phase is logged with its duration (`_progress`); the eval session is created on the first
eval step (`_session`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
import onnxruntime as ort
import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.config.options import ORTTrainerOptions
from ort_trainer.diagnosis import LabelSpec, find_label_inputs
from ort_trainer.graph import (
    BatchNormStats,
    add_optional_outputs,
    apply_forward_rewrites,
    apply_training_rewrites,
    convert_to_mixed_precision,
    copy_without_data,
    expand_where_inputs,
    export_torch_model,
    model_op_types,
    onnx_model_parameters,
    provider_fp16_support,
    strip_data,
    strip_loss_scaling,
    surface_batchnorm_statistics,
    unfuse_scaled_sum,
    with_values,
)

from ._memory import release_freed_memory
from ._progress import BuildProgress
from ._protocols import ModelParallel
from ._session import DeviceSpec, TrainingSession
from ._shared_arena import use_shared_cpu_arena
from ._store import ParamStore, graph_state_names

if TYPE_CHECKING:
    from ._trainer_state import TrainerState

__all__ = [
    "BuildRequest",
    "Engine",
    "build_onnxblock_engine",
    "engine_for",
    "save_debug_graph",
    "session_options_for",
]


@dataclass
class Engine:
    """The graphs and sessions, built on the first step over the `ParamStore`'s buffers (created earlier)."""

    store: ParamStore
    session: TrainingSession | Any  # TrainingSession, AutogradSession, or a Megatron segment session
    eval_model: onnx.ModelProto | None  # eval graph with parameters as inputs (None: the session builds it)
    input_dtypes: tuple[torch.dtype, ...]
    input_shapes: tuple[tuple[int, ...], ...]  # shapes traced at export (for clearer shape errors)
    bn_stats: list[BatchNormStats] = field(default_factory=list)
    zero_stage: int = 0
    loss_scale_input: str | None = None  # mixed precision: the graph's float32 loss-scale input
    loss_scale_feed: tuple[float, torch.Tensor] | None = None  # (the scale, the 0-d tensor fed with it): `_step`
    unused_inputs: tuple[str, ...] = ()  # model_desc inputs the graph does not read (accepted, not fed)
    label_specs: list[LabelSpec] = field(default_factory=list)  # inputs that reach a loss as class indices
    output_types: dict[str, int] = field(default_factory=dict)  # graph output -> ONNX elem type (legacy dtypes)
    tracks_batches: bool = False  # a train step runs BatchNorm in training mode (counts num_batches_tracked)

    # The state lives in the store; these read through so callers need not know where.
    layout = property(lambda self: self.store.layout)
    params = property(lambda self: self.store.params)
    grads = property(lambda self: self.store.grads)
    param_views = property(lambda self: self.store.param_views)
    grad_views = property(lambda self: self.store.grad_views)
    frozen = property(lambda self: self.store.frozen)
    optimizer = property(lambda self: self.store.optimizer)
    dist = property(lambda self: self.store.dist)
    zero = property(lambda self: self.store.zero)
    padded_params = property(lambda self: self.store.padded_params)
    padded_grads = property(lambda self: self.store.padded_grads)

    def eval_graph(self) -> onnx.ModelProto:
        """The eval graph with the state as inputs (built on demand by the autograd engine's session)."""
        return self.eval_model if self.eval_model is not None else self.session.eval_model

    def typed_description(self, desc: ModelDescription) -> ModelDescription:
        """``desc`` with the input dtypes the graph was built for and the graph's output dtypes (legacy)."""
        outputs = self.output_types or {o.name: o.type.tensor_type.elem_type for o in self.eval_model.graph.output}
        known = [name for name in desc.output_names if outputs.get(name) in _TORCH_DTYPES]
        dtypes = {name: _TORCH_DTYPES[outputs[name]] for name in known}
        return desc.with_input_dtypes(list(self.input_dtypes)).with_output_dtypes(dtypes)


_TORCH_DTYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.BOOL: torch.bool,
}


def engine_for(request: BuildRequest, session: Any, sample_inputs: Sequence[torch.Tensor], **fields: Any) -> Engine:
    """An `Engine` over ``request.store`` and ``session``, typed by the first step's inputs (every source's end)."""
    store = request.store
    return Engine(
        store=store,
        session=session,
        input_dtypes=tuple(t.dtype for t in sample_inputs),
        input_shapes=tuple(tuple(t.shape) for t in sample_inputs),
        zero_stage=request.zero_stage if store.dist is not None else 0,
        **fields,
    )


def session_options_for(options: ORTTrainerOptions) -> ort.SessionOptions:
    """The ORT session options of a trainer: the user's ``session_options`` or our defaults, plus debug options."""
    given = options.session_options
    session_options = given
    threads = options.utils.intra_op_threads
    if given is not None and threads:
        raise ValueError(
            f"options.utils.intra_op_threads={threads} and options.session_options are both given: our options "
            "apply to the session options we make; with your own, set session_options.intra_op_num_threads there"
        )
    if session_options is None:
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = threads  # 0: ORT's default, one thread per core
        session_options.log_severity_level = 3  # ORT warns about every unused exporter constant otherwise
        # ORT's spinning pool threads fight torch's OpenMP threads around the optimizer step (measured:
        # MLP step 16.3 -> 10.7 ms on 2 cores). Users who pass session_options decide for themselves.
        session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if options.device.id == "cpu":
            # ORT's memory pattern replays the first run's allocations as one planned block per run, kept
            # between steps; for a training graph that block is larger than what the arena needs without it
            # (GPT-2 124M: steady RSS 2963 -> 2733 MiB) and no faster (docs/performance.md, "Peak and steady memory").
            session_options.enable_mem_pattern = False
            # the training and eval sessions never run at once: one arena holds the scratch of both
            use_shared_cpu_arena(session_options)
    if options.debug.deterministic_compute:
        session_options.use_deterministic_compute = True
    optimized_path = options.debug.graph_save_paths.model_with_training_graph_after_optimization_path
    if optimized_path:
        session_options.optimized_model_filepath = optimized_path
    return session_options


@dataclass(frozen=True)
class BuildRequest:
    """What `build_engine` needs from the trainer."""

    model: torch.nn.Module | onnx.ModelProto
    loss_fn: Callable | None
    desc: ModelDescription
    store: ParamStore
    opset_version: int
    device: DeviceSpec
    session_options: ort.SessionOptions
    graph_save_paths: object | None = None
    extra_postprocess: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None  # _internal_use option
    zero_stage: int = 0
    mixed_precision: bool = False
    mixed_precision_dtype: str = "float16"  # mixed_precision.dtype: "float16" or "bfloat16" (autograd engine only)
    shrink_arena: bool = False  # utils.shrink_memory_arena
    horizontal: ModelParallel | None = None  # parallel.HorizontalParallel: Megatron segments instead of one session
    engine: str = "onnxblock"  # the graph source (`_sources.choose_engine`): "onnxblock" or "autograd"
    graph_cache: bool = True  # autograd engine: the on-disk cache of exported graphs (utils.graph_cache)

    @classmethod
    def from_state(cls, state: TrainerState) -> BuildRequest:
        """The request for a trainer's first build: its model, buffers and device, and the options that shape it."""
        options = state.options
        return cls(
            model=state.model,
            loss_fn=state.loss_fn,
            desc=state.model_desc,
            store=state.store,
            opset_version=options._internal_use.onnx_opset_version,
            device=state.device,
            session_options=session_options_for(options),
            graph_save_paths=options.debug.graph_save_paths,
            extra_postprocess=options._internal_use.extra_postprocess,
            zero_stage=options.distributed.deepspeed_zero_optimization.stage,
            mixed_precision=bool(options.mixed_precision.enabled),
            mixed_precision_dtype=options.mixed_precision.dtype,
            shrink_arena=bool(options.utils.shrink_memory_arena),
            horizontal=state.horizontal,
            engine=state.engine_name,
            graph_cache=bool(options.utils.graph_cache),
        )


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
        eval_model=eval_model,
        bn_stats=bn_stats,
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
    """Megatron: the graph cut into segments with collectives between them (ort_trainer.parallel)."""
    store = request.store
    store.optimizer.set_idle([name for name in store.layout.names if name not in set(trainable)])
    session = request.horizontal.build_session(forward, trainable, sorted(frozen), store, request)
    release_freed_memory()
    return engine_for(
        request,
        session,
        sample_inputs,
        eval_model=forward,
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
    from ._onnxblock_graphs import build_training_graphs  # onnxruntime-training: imported only by this engine

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


def save_debug_graph(request: BuildRequest, attribute: str, model: onnx.ModelProto, values=None) -> None:
    """Write a debug graph (``graph_save_paths``); shell initializers get the state's values (a complete model)."""
    path = getattr(request.graph_save_paths, attribute, "") if request.graph_save_paths is not None else ""
    if path:
        onnx.save(with_values(model, values) if values else model, path)
