"""`build_autograd_engine`: the autograd engine's `Engine`, for a torch module on any ``onnxruntime``.

The graphs come from PyTorch's autograd (`ort_trainer.graph.autograd`): traced in fake mode (no compute,
the module untouched), exported with the dynamo exporter, cached on disk by graph structure and
versions (`GraphCache`). They run in a stock ``InferenceSession`` over the same `ParamStore` buffers,
optimizer, checkpoints and distributed update as the onnxblock engine (`AutogradSession`).

A user-given ``onnx.ModelProto`` is trained as an `OnnxModule` (its standard ops as torch ops, its float
initializers as parameters under their ONNX names): the same trace, export and session. Mixed precision is
PyTorch's (`_autograd_precision`): the step traced under ``torch.autocast`` where the provider has low-precision
kernels, the backward from ``loss * loss_scale`` (a graph input the step feeds).

What this engine cannot do yet raises here, naming the engine that can (docs/engines.md): ONNX ops without a
torch route, Megatron segments, and ``_internal_use.extra_postprocess`` (it edits the onnxblock forward graph).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence

import onnx
import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.diagnosis import LabelSpec
from ort_trainer.graph import explain_trace_failure, onnx_model_parameters
from ort_trainer.graph.autograd import (
    LOSS_SCALE_INPUT,
    GraphCache,
    OnnxModule,
    Precision,
    SymbolicShapesError,
    TracedGraph,
    TraceError,
    class_index_inputs,
    graph_cache_from_env,
    graph_to_onnx,
    onnx_model_problems,
    trace_graph,
)

from ._autograd_precision import autograd_precision, report_fallbacks
from ._autograd_session import AutogradGraphs, AutogradSession
from ._build import BuildRequest, Engine, engine_for, save_debug_graph
from ._memory import release_freed_memory
from ._progress import BuildProgress

__all__ = ["build_autograd_engine", "check_autograd_onnx_model", "check_autograd_supported", "exported_graph"]

_log = logging.getLogger("ort_trainer")
_ONNXBLOCK = "options={'utils': {'engine': 'onnxblock'}} (needs onnxruntime-training: docs/engines.md)"
_METADATA = "ort_trainer.traced"  # the finished graph's names, stored in the cached model (`TracedGraph.metadata`)


def check_autograd_supported(model: object, *, horizontal: bool, extra_postprocess: object | None) -> None:
    """ValueError naming what the autograd engine cannot do yet and the engine that can."""
    problems = []
    if horizontal:
        problems.append("distributed.horizontal_parallel_size > 1 (Megatron segments)")
    if extra_postprocess is not None:
        problems.append("_internal_use.extra_postprocess (it edits the onnxblock engine's forward graph)")
    if problems:
        raise ValueError(f"the autograd engine does not support {'; '.join(problems)} yet; use {_ONNXBLOCK}")


def check_autograd_onnx_model(model: onnx.ModelProto, desc: ModelDescription) -> None:
    """ValueError naming every part of a user-given ONNX model that the autograd engine cannot run (every op
    without a torch route, by op type and node name), or a graph input that no ``model_desc`` input feeds."""
    held = {init.name for init in model.graph.initializer}
    unfed = [i.name for i in model.graph.input if i.name not in held and i.name not in desc.input_names]
    if unfed:
        raise ValueError(
            f"the ONNX model's graph inputs {unfed} are not model_desc inputs; list every graph input that is not "
            f"an initializer in model_desc['inputs'] (it has {list(desc.input_names)})"
        )
    problems = onnx_model_problems(model, onnx_model_parameters(model))
    if problems:
        raise ValueError(f"the autograd engine cannot train this ONNX model: {'; '.join(problems)}; use {_ONNXBLOCK}")


def build_autograd_engine(request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
    """Trace + export (or load from the graph cache) the training graph, open its session."""
    check_autograd_supported(
        request.model,
        horizontal=request.horizontal is not None,
        extra_postprocess=request.extra_postprocess,
    )
    precision = autograd_precision(request.mixed_precision, request.mixed_precision_dtype, request.device.providers)
    store, desc = request.store, request.desc
    if isinstance(request.model, onnx.ModelProto):  # its parameters are the store's tensors, under the ONNX names
        request = dataclasses.replace(request, model=OnnxModule(request.model, store.weights, store.layout.names))
    trainable = {name: store.param_views[name] for name in store.layout.names}
    frozen = dict(store.frozen)
    first_inputs = dict(zip(desc.input_names, sample_inputs, strict=True))
    cache = graph_cache_from_env(request.graph_cache)
    constants: dict[str, torch.Tensor] = {}
    label_specs: list[LabelSpec] = []  # model_desc inputs a loss reads as class indices (found in the first graph)
    # the input dims model_desc names with a string: one graph serves every size of them (graph.autograd._symbolic),
    # unless the exporter cannot keep them symbolic (then one graph per shape, said once: `_symbolic_or_static`)
    shapes = _Shapes({n: a for n, a in desc.dynamic_axes().items() if n in desc.input_names})

    def build(feeds: Mapping[str, torch.Tensor] | None, training: bool) -> AutogradGraphs:
        """The graphs for ``feeds`` (None: the first inputs): traced, then loaded from the cache under the trace's
        key (`exported_graph`), else exported and stored."""
        inputs = [first_inputs[n] if feeds is None or n not in feeds else feeds[n] for n in desc.input_names]
        traced, model = shapes.trace_and_export(
            lambda axes: trace_graph(
                request.model,
                request.loss_fn,
                desc,
                trainable,
                frozen,
                inputs,
                training=training,
                precision=precision,
                dynamic=axes,
            ),
            lambda traced: exported_graph(traced, cache, training, precision),
        )
        count = traced.state_count  # the state comes first (a cached graph's names then list its random inputs too)
        for name, value in zip(traced.input_names[:count], traced.sample_args[:count], strict=True):
            if name not in trainable and name not in frozen and name not in desc.input_names:
                constants.setdefault(name, _buffer_input(store.buffers, name, value))
        if feeds is None and training:
            label_specs[:] = _label_specs(traced, desc)
        return AutogradGraphs(model, traced.names(), dict(zip(desc.input_names, inputs, strict=True)))

    def explain(feeds: Mapping[str, torch.Tensor], error: Exception) -> Exception | None:
        """A failed run (a label out of range...) explained by PyTorch on the same inputs, naming the input."""
        inputs = [feeds.get(n, first_inputs[n]) for n in desc.input_names]
        explained = explain_trace_failure(request.model, request.loss_fn, desc, inputs, RuntimeError(str(error)))
        if explained is not None:
            explained.explained = True  # `diagnosis.explain_run_errors` passes it on as it is
        return explained

    progress = BuildProgress(2, "ORTTrainer build (autograd engine)")
    try:
        with progress.phase("trace and export the training graph"):
            first = build(None, True)
            report_fallbacks(first.model, precision, request.device.providers)
        with progress.phase("training session"):
            session = AutogradSession(
                build,
                first,
                trainable,
                {name: store.grad_views[name] for name in store.layout.names},
                store.padded_grads,
                frozen,
                constants,
                list(desc.output_names),
                request.device,
                request.session_options,
                request.shrink_arena,
                explain=explain,
                step_inputs=precision.extra_inputs(True),
            )
    except TraceError as error:
        raise _explained_trace_error(request, error, list(sample_inputs)) from error
    _note_unused_inputs(first.names.unused_inputs)
    save_debug_graph(request, "model_with_gradient_graph_path", first.model)
    save_debug_graph(request, "model_with_training_graph_path", first.model)
    store.optimizer.set_idle(first.names.idle)
    if first.names.idle:
        _log.info("parameters the loss does not reach (never updated): %s", first.names.idle)
    release_freed_memory()  # the trace leaves cycles
    progress.close()
    return engine_for(  # every input is passed to the session, which feeds its graph those it reads
        request,
        session,
        sample_inputs,
        eval_model=None,
        output_types=_output_types(first.model),
        # the graph itself writes BatchNorm's num_batches_tracked (a buffer its forward writes): no count beside it
        tracks_batches=False,
        label_specs=label_specs,
        loss_scale_input=LOSS_SCALE_INPUT if precision.loss_scale else None,
    )


def _label_specs(traced: TracedGraph, desc: ModelDescription) -> list[LabelSpec]:
    """The ``model_desc`` inputs a cross-entropy / NLL loss reads as class indices: checked before every run
    (`diagnosis.check_labels`), since the graph's gather would take a negative label as a class from the end.
    On a GPU they are not checked per step (that would be a host round trip each step)."""
    names = traced.input_names
    return [
        LabelSpec(names[found.position], found.classes, found.ignore_index, "nll_loss", on_device=False)
        for found in class_index_inputs(traced.module)
        if found.position < len(names) and names[found.position] in desc.input_names
    ]


def _buffer_input(buffers: Mapping[str, torch.Tensor], name: str, sample: torch.Tensor) -> torch.Tensor:
    """The tensor the graph input of the module's buffer ``name`` is bound to: the store's (`ParamStore.buffers`),
    which the module's buffer is a view of, so that what the user writes between steps is what the next step
    reads. A buffer the store does not hold (one registered after the trainer was built) is refused by name: a
    copy taken now would silently ignore every later write."""
    held = buffers.get(name)
    if held is None or held.shape != sample.shape or held.dtype != sample.dtype:
        raise ValueError(
            f"the module's buffer {name!r} ({sample.dtype}, shape {list(sample.shape)}) is not the one it had when "
            "the ORTTrainer was built (registered or replaced afterwards); register every buffer before building "
            "the trainer, and change its value in place (buffer.fill_(...), buffer.copy_(...))"
        )
    return held


class _Shapes:
    """Which input dims the engine's graphs keep symbolic: ``model_desc``'s named dims, until an export cannot keep
    them (then every later graph is per shape). Each fallback and each dim the model's code makes static is said
    once, with the reason and the line."""

    def __init__(self, axes: dict[str, dict[int, str]]):
        self.axes = axes
        self._told: set[str] = set()

    def trace_and_export(self, trace: Callable, export: Callable) -> tuple[TracedGraph, onnx.ModelProto]:
        """``trace(axes)`` then ``export(traced)``; traced again without symbolic dims where the export refuses them."""
        traced = trace(self.axes)
        try:
            model = export(traced)
        except SymbolicShapesError as error:
            self._tell(
                "fallback",
                f"the autograd engine cannot keep the input dims {_named(self.axes)} symbolic for this model "
                f"({error}); it builds one graph per input shape instead (a new shape costs a trace and an export)",
            )
            self.axes = {}
            traced = trace(self.axes)
            model = export(traced)
        for dim in traced.specialised:
            self._tell(
                dim.name,
                f"model_desc names the dim {dim.name!r}, but the model's code makes it static (size {dim.size}, at "
                f"{dim.where}): the autograd engine builds one graph per size of it",
            )
        return traced, model

    def _tell(self, what: str, message: str) -> None:
        if what not in self._told:
            self._told.add(what)
            warnings.warn(message, UserWarning, stacklevel=2)


def _named(axes: Mapping[str, Mapping[int, str]]) -> list[str]:
    return sorted({label for dims in axes.values() for label in dims.values()})


def _note_unused_inputs(unused: Sequence[str]) -> None:
    if unused:
        warnings.warn(
            f"model_desc inputs {list(unused)} are not used by the model (the traced graph does not read them); "
            "train_step and eval_step still accept them and ignore them",
            UserWarning,
            stacklevel=7,
        )


def _output_types(model: onnx.ModelProto) -> dict[str, int]:
    return {o.name: o.type.tensor_type.elem_type for o in model.graph.output}


def _explained_trace_error(request: BuildRequest, error: TraceError, inputs: Sequence[torch.Tensor]) -> Exception:
    """A trace failure caused by an input the model or the loss rejects, named as PyTorch would say it; else
    the trace error itself."""
    cause = error.__cause__ if isinstance(error.__cause__, RuntimeError | IndexError | TypeError) else None
    cause = cause or RuntimeError(str(error))  # an ONNX Runtime load error: PyTorch decides if an input is at fault
    explained = explain_trace_failure(request.model, request.loss_fn, request.desc, list(inputs), cause)
    return explained if explained is not None else error


def _cache_options(training: bool, precision: Precision) -> dict[str, object]:
    return {"training": training, "opset": "exporter-default", **precision.cache_options()}


def exported_graph(
    traced: TracedGraph, cache: GraphCache | None, training: bool, precision: Precision
) -> onnx.ModelProto:
    """The ONNX graph of ``traced`` (what ``export_training`` writes too): from the cache when it holds this key
    (the finished graph's names come with it, so the functionalising second trace, the export and its passes are
    skipped), else finished, exported and stored."""
    if cache is None:
        return _export(traced)
    key = cache.key(traced.fingerprint(), _cache_options(training, precision))
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(cache.building(key))
        except OSError as error:  # a read-only or full cache folder must not stop training
            _log.warning("graph cache %s unusable (%s): exporting without it", cache.directory, error)
            return _export(traced)
        model = cache.get(key)
        metadata = {p.key: p.value for p in model.metadata_props} if model is not None else {}
        if _METADATA in metadata:
            traced.apply_metadata(metadata[_METADATA])
            _log.info("graph cache: %s graph loaded from %s", "training" if training else "eval", cache.directory)
            return model
        model = _export(traced)
        try:
            cache.put(key, model)
        except OSError as error:
            _log.warning("graph cache %s: could not store the graph (%s)", cache.directory, error)
        return model


def _export(traced: TracedGraph) -> onnx.ModelProto:
    traced.finish()
    model = graph_to_onnx(traced)
    onnx.helper.set_model_props(model, {_METADATA: traced.metadata()})
    return model
