"""`build_autograd_engine`: the autograd engine's `Engine`, for a torch module on any ``onnxruntime``.

The graphs come from PyTorch's autograd (`ort_trainer.graph.autograd`): traced in fake mode (no compute,
the module untouched), exported with the dynamo exporter, cached on disk by graph structure and
versions (`GraphCache`). They run in a stock ``InferenceSession`` over the same `ParamStore` buffers,
optimizer, checkpoints and distributed update as the onnxblock engine (`AutogradSession`).

What this engine cannot do yet raises here, naming the engine that can (docs/engines.md): an
``onnx.ModelProto`` model (there is no PyTorch autograd to ask), mixed precision (fp16 graphs),
Megatron segments, and ``_internal_use.extra_postprocess`` (it edits the onnxblock forward graph).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Mapping, Sequence

import onnx
import torch

from ort_trainer.graph import explain_trace_failure
from ort_trainer.graph.autograd import (
    GraphCache,
    TracedGraph,
    TraceError,
    graph_cache_from_env,
    graph_to_onnx,
    trace_graph,
)

from ._autograd_session import AutogradGraphs, AutogradSession
from ._build import BuildRequest, Engine, engine_for, save_debug_graph
from ._memory import release_freed_memory
from ._progress import BuildProgress

__all__ = ["build_autograd_engine", "check_autograd_supported"]

_log = logging.getLogger("ort_trainer")
_ONNXBLOCK = "options={'utils': {'engine': 'onnxblock'}} (needs onnxruntime-training: docs/engines.md)"
_METADATA = "ort_trainer.traced"  # the finished graph's names, stored in the cached model (`TracedGraph.metadata`)


def check_autograd_supported(
    model: object, *, mixed_precision: bool, horizontal: bool, extra_postprocess: object | None
) -> None:
    """ValueError naming what the autograd engine cannot do yet and the engine that can."""
    problems = []
    if isinstance(model, onnx.ModelProto):
        problems.append("an onnx.ModelProto model (it has no PyTorch autograd to take the gradients from)")
    if mixed_precision:
        problems.append("mixed_precision.enabled (fp16 graphs)")
    if horizontal:
        problems.append("distributed.horizontal_parallel_size > 1 (Megatron segments)")
    if extra_postprocess is not None:
        problems.append("_internal_use.extra_postprocess (it edits the onnxblock engine's forward graph)")
    if problems:
        raise ValueError(f"the autograd engine does not support {'; '.join(problems)} yet; use {_ONNXBLOCK}")


def build_autograd_engine(request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
    """Trace + export (or load from the graph cache) the training graph, open its session."""
    check_autograd_supported(
        request.model,
        mixed_precision=request.mixed_precision,
        horizontal=request.horizontal is not None,
        extra_postprocess=request.extra_postprocess,
    )
    store, desc = request.store, request.desc
    trainable = {name: store.param_views[name] for name in store.layout.names}
    frozen = dict(store.frozen)
    first_inputs = dict(zip(desc.input_names, sample_inputs, strict=True))
    cache = graph_cache_from_env(request.graph_cache)
    constants: dict[str, torch.Tensor] = {}

    def build(feeds: Mapping[str, torch.Tensor] | None, training: bool) -> AutogradGraphs:
        inputs = [first_inputs[n] if feeds is None or n not in feeds else feeds[n] for n in desc.input_names]
        traced = trace_graph(request.model, request.loss_fn, desc, trainable, frozen, inputs, training=training)
        for name, value in zip(traced.input_names, traced.sample_args, strict=True):
            if name not in trainable and name not in frozen and name not in desc.input_names:
                constants.setdefault(name, value.detach().clone())
        return AutogradGraphs(_exported(traced, cache, request, training), traced)

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
            )
    except TraceError as error:  # an input the model or the loss rejects: named, as PyTorch would say it
        cause = error.__cause__ if isinstance(error.__cause__, RuntimeError | IndexError | TypeError) else None
        cause = cause or RuntimeError(str(error))  # an ONNX Runtime load error: PyTorch decides if an input is at fault
        explained = explain_trace_failure(request.model, request.loss_fn, desc, list(sample_inputs), cause)
        if explained is not None:
            raise explained from error
        raise
    if first.traced.unused_inputs:
        warnings.warn(
            f"model_desc inputs {list(first.traced.unused_inputs)} are not used by the model (the traced graph "
            "does not read them); train_step and eval_step still accept them and ignore them",
            UserWarning,
            stacklevel=5,
        )
    save_debug_graph(request, "model_with_gradient_graph_path", first.model)
    save_debug_graph(request, "model_with_training_graph_path", first.model)
    store.optimizer.set_idle(first.traced.idle)
    if first.traced.idle:
        _log.info("parameters the loss does not reach (never updated): %s", first.traced.idle)
    release_freed_memory()
    progress.close()
    return engine_for(
        request,
        session,
        sample_inputs,
        eval_model=None,
        unused_inputs=first.traced.unused_inputs,
        output_types={o.name: o.type.tensor_type.elem_type for o in first.model.graph.output},
        tracks_batches=bool(first.traced.updated),  # BatchNorm statistics are the buffers a forward writes
    )


def _exported(traced: TracedGraph, cache: GraphCache | None, request: BuildRequest, training: bool) -> onnx.ModelProto:
    """The ONNX graph of ``traced``: from the cache when it holds this key (the finished graph's names come
    with it, so the functionalising second trace is skipped), else finished, exported and stored."""
    if cache is None:
        return _export(traced)
    key = cache.key(traced.fingerprint(), {"training": training, "opset": "exporter-default"})
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
