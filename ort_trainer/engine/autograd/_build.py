"""`build_autograd_engine`: the autograd engine's `Engine`, for a torch module on any ``onnxruntime``.

The graphs come from PyTorch's autograd (`ort_trainer.graph.autograd`): traced in fake mode (no compute,
the module untouched), exported with the dynamo exporter, cached on disk by graph structure and
versions (`GraphCache`). They run in a stock ``InferenceSession`` over the same `ParamStore` buffers,
optimizer, checkpoints and distributed update as the onnxblock engine (`AutogradSession`).

A user-given ``onnx.ModelProto`` is trained as an `OnnxModule` (its standard ops as torch ops, its float
initializers as parameters under their ONNX names): the same trace, export and session. Mixed precision is
PyTorch's (`_precision`): the step traced under ``torch.autocast`` where the provider has low-precision
kernels, the backward from ``loss * loss_scale`` (a graph input the step feeds).

What this engine cannot do yet raises here, naming the engine that can (docs/engines.md): ONNX ops without a
torch route, Megatron segments, and ``_internal_use.extra_postprocess`` (it edits the onnxblock forward graph).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence

import onnx
import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.config.options import ORTTrainerOptions
from ort_trainer.diagnosis import LabelSpec
from ort_trainer.graph import explain_trace_failure, onnx_model_parameters
from ort_trainer.graph.autograd import (
    LOSS_SCALE_INPUT,
    GraphCache,
    GraphNames,
    OnnxModule,
    Precision,
    SymbolicShapesError,
    TracedGraph,
    TraceError,
    build_in_child,
    class_index_inputs,
    export_in_child,
    get_or_build,
    graph_cache_from_env,
    graph_to_onnx,
    onnx_model_problems,
    trace_graph,
)
from ort_trainer.runtime import release_freed_memory

from .._build import BuildRequest, Engine, engine_for, save_debug_graph
from .._progress import BuildProgress
from ._precision import autograd_precision, report_fallbacks
from ._session import AutogradGraphs, AutogradSession

__all__ = ["build_autograd_engine", "check_autograd_supported", "exported_graph"]

_log = logging.getLogger("ort_trainer")
_ONNXBLOCK = "options={'utils': {'engine': 'onnxblock'}} (needs onnxruntime-training: docs/engines.md)"
_DEFAULT_OPSET = 17  # the default of _internal_use.onnx_opset_version (config._sections.InternalUseOptions)
_METADATA = "ort_trainer.traced"  # the finished graph's names, stored in the cached model (`TracedGraph.metadata`)
_OUTCOME = "ort_trainer.build_outcome"  # what a build tells the builder (`_GraphBuilder._built`), never cached


def check_autograd_supported(model: object, options: ORTTrainerOptions, desc: ModelDescription) -> None:
    """ValueError naming what the autograd engine cannot do yet, or an option it would ignore, and the engine
    that can; for a user-given ONNX model, every part of it the engine cannot run."""
    problems = []
    if options.distributed.horizontal_parallel_size > 1:
        problems.append("distributed.horizontal_parallel_size > 1 (Megatron segments)")
    if options._internal_use.extra_postprocess is not None:
        problems.append("_internal_use.extra_postprocess (it edits the onnxblock engine's forward graph)")
    opset = options._internal_use.onnx_opset_version
    if opset != _DEFAULT_OPSET:  # the dynamo exporter picks its own opset: the option would be dropped
        problems.append(f"_internal_use.onnx_opset_version={opset} (its exporter chooses the opset)")
    if options.debug.graph_save_paths.model_after_graph_transforms_path:
        problems.append("debug.graph_save_paths.model_after_graph_transforms_path (the onnxblock forward graph)")
    if problems:
        raise ValueError(f"the autograd engine does not support {'; '.join(problems)} yet; use {_ONNXBLOCK}")
    if isinstance(model, onnx.ModelProto):
        _check_onnx_model(model, desc)


def _check_onnx_model(model: onnx.ModelProto, desc: ModelDescription) -> None:
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
    builder = _GraphBuilder(request, sample_inputs)
    request, store = builder.request, builder.store
    progress = BuildProgress(2, "ORTTrainer build (autograd engine)")
    try:
        with progress.phase("trace and export the training graph"):
            first = builder.graphs(None, True)
            report_fallbacks(first.model, builder.precision, request.device.providers)
        with progress.phase("training session"):
            session = builder.session(first)
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
        output_types=_output_types(first.model),
        # the graph itself writes BatchNorm's num_batches_tracked (a buffer its forward writes): no count beside it
        tracks_batches=False,
        label_specs=builder.label_specs,
        loss_scale_input=LOSS_SCALE_INPUT if builder.precision.loss_scale else None,
    )


class _GraphBuilder:
    """The graphs of one trainer, built when they are needed: the first step's, then one for each input signature
    the session meets (`graphs`); and a failed run explained by PyTorch (`explain`). The session holds these two
    bound methods, nothing else of the build.

    What every graph shares lives here: the model (a user's ONNX model as an `OnnxModule` over the store's
    tensors), the state it is traced over, the precision, the graph cache, the input dims kept symbolic
    (`_Shapes`), and what the graphs found: the module's buffers they read (``constants``) and the inputs a loss
    reads as class indices (``label_specs``, from the first training graph)."""

    def __init__(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]):
        store, desc = request.store, request.desc
        if isinstance(request.model, onnx.ModelProto):  # its parameters are the store's tensors, under the ONNX names
            request = dataclasses.replace(request, model=OnnxModule(request.model, store.weights, store.layout.names))
        self.request, self.store, self.desc = request, store, desc
        self.precision = autograd_precision(
            request.mixed_precision, request.mixed_precision_dtype, request.device.providers
        )
        self.trainable = {name: store.param_views[name] for name in store.layout.names}
        self.frozen = dict(store.frozen)
        self.first_inputs = dict(zip(desc.input_names, sample_inputs, strict=True))
        self.cache = graph_cache_from_env(request.graph_cache)
        self.constants: dict[str, torch.Tensor] = {}
        self.label_specs: list[LabelSpec] = []
        # the input dims model_desc names with a string: one graph serves every size of them (graph.autograd.
        # _symbolic), unless the exporter cannot keep them symbolic (then one graph per shape, said once: `_Shapes`)
        self.shapes = _Shapes({n: a for n, a in desc.dynamic_axes().items() if n in desc.input_names})

    def graphs(self, feeds: Mapping[str, torch.Tensor] | None, training: bool) -> AutogradGraphs:
        """The graphs for ``feeds`` (None: the first inputs): traced, then loaded from the cache under the trace's
        key (`exported_graph`), else exported and stored. A model big enough to export in a child
        (`export_in_child`) is traced in that child too: the trace's imports and heap (~40 MiB at BERT small, the
        difference between its peak RSS and eager PyTorch's) then never join the training process either."""
        desc = self.desc
        inputs = [self.first_inputs[n] if feeds is None or n not in feeds else feeds[n] for n in desc.input_names]
        if export_in_child([*self.trainable.values(), *self.frozen.values(), *inputs]):
            model = build_in_child(lambda: self._built(inputs, training), "training" if training else "eval")
        else:
            model = self._built(inputs, training)
        self._take(_popped_outcome(model), first_training=feeds is None and training)
        names = GraphNames.from_json(_metadata(model)[_METADATA])
        return AutogradGraphs(model, names, dict(zip(desc.input_names, inputs, strict=True)))

    def _built(self, inputs: list[torch.Tensor], training: bool) -> onnx.ModelProto:
        """Trace and export (or load) the graph of ``inputs``; what the builder learns from the trace rides in the
        model's metadata (`_OUTCOME`), the one thing a child can send back: `_take` applies it."""
        traced, model = self.shapes.trace_and_export(
            lambda axes: self._trace(inputs, training, axes),
            lambda traced: exported_graph(traced, self.cache, training, self.precision),
        )
        outcome = {
            "constants": self._constant_names(traced),
            "labels": [dataclasses.asdict(spec) for spec in _label_specs(traced, self.desc)] if training else [],
            "shapes": self.shapes.state(),
        }
        model.metadata_props.add(key=_OUTCOME, value=json.dumps(outcome))
        return model

    def _take(self, outcome: dict, first_training: bool) -> None:
        """Apply a build's `_built` outcome here: the buffers its graph reads, its label inputs (from the first
        training graph), which dims stay symbolic and which fallbacks were said."""
        for name in outcome["constants"]:
            self.constants.setdefault(name, self.store.buffers[name])
        if first_training:
            self.label_specs[:] = [LabelSpec(**spec) for spec in outcome["labels"]]
        self.shapes.restore(outcome["shapes"])

    def explain(self, feeds: Mapping[str, torch.Tensor], error: Exception) -> Exception | None:
        """A failed run (a label out of range...) explained by PyTorch on the same inputs, naming the input."""
        inputs = [feeds.get(n, self.first_inputs[n]) for n in self.desc.input_names]
        request = self.request
        return explain_trace_failure(request.model, request.loss_fn, self.desc, inputs, RuntimeError(str(error)))

    def session(self, first: AutogradGraphs) -> AutogradSession:
        """The session over the store's buffers, opened on the first graphs; it asks `graphs` for the others."""
        request, store = self.request, self.store
        return AutogradSession(
            self.graphs,
            first,
            self.trainable,
            {name: store.grad_views[name] for name in store.layout.names},
            store.padded_grads,
            self.frozen,
            self.constants,
            list(self.desc.output_names),
            request.device,
            request.session_options,
            request.shrink_arena,
            explain=self.explain,
            step_inputs=self.precision.extra_inputs(True),
        )

    def _trace(self, inputs: list[torch.Tensor], training: bool, axes: dict) -> TracedGraph:
        request = self.request
        return trace_graph(
            request.model,
            request.loss_fn,
            self.desc,
            self.trainable,
            self.frozen,
            inputs,
            training=training,
            precision=self.precision,
            dynamic=axes,
        )

    def _constant_names(self, traced: TracedGraph) -> list[str]:
        """The module's buffers the graph reads beside the state, each checked against the store's
        (`_buffer_input`), which the session binds them to."""
        count = traced.state_count  # the state comes first (a cached graph's names then list its random inputs too)
        found = []
        for name, value in zip(traced.input_names[:count], traced.sample_args[:count], strict=True):
            if name not in self.trainable and name not in self.frozen and name not in self.desc.input_names:
                _buffer_input(self.store.buffers, name, value)
                found.append(name)
        return found


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

    def state(self) -> dict:
        """What `restore` takes back (JSON): the dims kept symbolic and the fallbacks said."""
        return {"axes": self.axes, "told": sorted(self._told)}

    def restore(self, state: dict) -> None:
        """Take the state a build in a child ended with (JSON turned the axes into strings)."""
        self.axes = {name: {int(axis): label for axis, label in dims.items()} for name, dims in state["axes"].items()}
        self._told.update(state["told"])

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
    """The ONNX graph of ``traced`` (what ``export_training`` writes too): from the cache when it holds this key with
    the finished graph's names (so the functionalising second trace, the export and its passes are skipped), else
    finished, exported and stored."""
    what = "training" if training else "eval"

    def build() -> onnx.ModelProto:
        if not export_in_child(traced.sample_args):
            return _export(traced)
        model = build_in_child(lambda: _export(traced), what)  # `traced` is finished in the child
        traced.apply_metadata(_metadata(model)[_METADATA])  # here, as on a cache hit
        return model

    model, hit = get_or_build(cache, traced, _cache_options(training, precision), build, usable=_has_names)
    if hit:
        traced.apply_metadata(_metadata(model)[_METADATA])
        _log.info("graph cache: %s graph loaded from %s", what, cache.directory)
    return model


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _popped_outcome(model: onnx.ModelProto) -> dict:
    """`_GraphBuilder._built`'s outcome, taken out of the model's metadata."""
    props = model.metadata_props
    index = next(i for i, prop in enumerate(props) if prop.key == _OUTCOME)
    outcome = json.loads(props[index].value)
    del props[index]
    return outcome


def _has_names(model: onnx.ModelProto) -> bool:
    """Whether a cached graph carries the finished graph's names (`TracedGraph.metadata`) that bind it."""
    return _METADATA in _metadata(model)


def _export(traced: TracedGraph) -> onnx.ModelProto:
    traced.finish()
    model = graph_to_onnx(traced)
    onnx.helper.set_model_props(model, {_METADATA: traced.metadata()})
    return model
