"""The autograd engine's training and eval graphs of a trainer's model, for an artifact.

The same trace and export as ``ORTTrainer``'s autograd engine (`engine._autograd_build`): forward + backward
traced by PyTorch (`graph.autograd.trace_graph`), exported to standard ONNX ops with the ``model_desc`` dims kept
symbolic, random draws (Dropout) lifted to graph inputs, through the same graph cache. Nothing of the trainer's
session is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import onnx
import torch

from ort_trainer.engine import TrainerState, exported_graph
from ort_trainer.graph.autograd import (
    OnnxModule,
    Precision,
    SymbolicShapesError,
    TracedGraph,
    graph_cache_from_env,
    trace_graph,
)

__all__ = ["ExportedGraph", "export_graphs"]


@dataclass
class ExportedGraph:
    model: onnx.ModelProto
    traced: TracedGraph


def export_graphs(state: TrainerState, inputs: Sequence[torch.Tensor]) -> tuple[ExportedGraph, ExportedGraph]:
    """(training graph, eval graph) of the trainer's model for sample ``inputs`` (one per ``model_desc`` input);
    ValueError when the exporter cannot keep the named dims symbolic (an artifact is one graph for every size); a
    dim the model's own code fixes (a Linear's features) is static in the artifact, with a warning."""
    store, desc = state.store, state.model_desc
    model = state.model
    if isinstance(model, onnx.ModelProto):
        model = OnnxModule(model, store.weights, store.layout.names)
    trainable = {name: store.param_views[name] for name in store.layout.names}
    frozen = dict(store.frozen)
    axes = {n: a for n, a in desc.dynamic_axes().items() if n in desc.input_names}
    cache = graph_cache_from_env(state.options.utils.graph_cache)  # the trainer's cache: one export for both
    graphs = []
    for training in (True, False):
        traced = trace_graph(
            model, state.loss_fn, desc, trainable, frozen, list(inputs), training=training, dynamic=axes
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                exported = exported_graph(traced, cache, training, Precision())
            except SymbolicShapesError as error:
                raise ValueError(
                    f"export_training: the {'training' if training else 'eval'} graph cannot keep the dims "
                    f"{sorted({d for a in axes.values() for d in a.values()})} symbolic ({error}); a training "
                    "artifact is one graph for every size of them"
                ) from error
        kept = {label for dims in traced.dynamic.values() for label in dims.values()}
        static = sorted({label for dims in axes.values() for label in dims.values()} - kept)
        if static and training:
            warnings.warn(
                f"export_training: the model's code makes the dims {static} static (a Linear's input features, a "
                "reshape to a literal...): the artifact takes only the traced size of them",
                UserWarning,
                stacklevel=3,
            )
        graphs.append(ExportedGraph(exported, traced))
    return graphs[0], graphs[1]
