"""What every graph source builds from and into: `BuildRequest` (the trainer's side) and `Engine` (the result).

Runs once, on the first `train_step`/`eval_step` (the exporter needs real inputs to trace).
`_sources.build_engine` hands the request to the graph source the trainer chose (the ``engine.autograd`` or the
``engine.onnxblock`` wing); each ends with `engine_for`, an `Engine` over the store's buffers and its
`StepSession`. `session_options_for` gives the ORT session options a trainer's sessions share, and
`save_debug_graph` writes the ``debug.graph_save_paths`` files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
import onnxruntime as ort
import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.config.options import ORTTrainerOptions
from ort_trainer.diagnosis import LabelSpec
from ort_trainer.graph import with_values
from ort_trainer.runtime import DeviceSpec, use_shared_cpu_arena

from ._protocols import ModelParallel
from ._step_session import StepSession
from ._store import ParamStore

if TYPE_CHECKING:
    from ._trainer_state import TrainerState

__all__ = ["BuildRequest", "Engine", "engine_for", "save_debug_graph", "session_options_for"]


@dataclass
class Engine:
    """The graphs and sessions, built on the first step over the `ParamStore`'s buffers (created earlier)."""

    store: ParamStore
    session: StepSession  # the onnxblock or autograd engine's session, or a Megatron segment session
    input_dtypes: tuple[torch.dtype, ...]
    input_shapes: tuple[tuple[int, ...], ...]  # shapes traced at export (for clearer shape errors)
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
        """A copy of the eval graph with the state as inputs, for any onnxruntime (`StepSession.eval_graph`)."""
        return self.session.eval_graph()

    def typed_description(self, desc: ModelDescription) -> ModelDescription:
        """``desc`` with the input dtypes the graph was built for and the graph's output dtypes (legacy)."""
        outputs = self.output_types or {o.name: o.type.tensor_type.elem_type for o in self.eval_graph().graph.output}
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


def engine_for(
    request: BuildRequest, session: StepSession, sample_inputs: Sequence[torch.Tensor], **fields: Any
) -> Engine:
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
        # nodes in the graph's own order (the forward, then the backward from the loss down, each tensor freed
        # soon after its last reader) rather than ORT's default depth-first order, which held more at once
        # (peak RSS at GPT-2 124M, batch 4 x 128: -81 MiB; docs/engines.md, "Variable-length batches")
        session_options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
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


def save_debug_graph(request: BuildRequest, attribute: str, model: onnx.ModelProto, values=None) -> None:
    """Write a debug graph (``graph_save_paths``); shell initializers get the state's values (a complete model)."""
    path = getattr(request.graph_save_paths, attribute, "") if request.graph_save_paths is not None else ""
    if path:
        onnx.save(with_values(model, values) if values else model, path)
