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
from ort_trainer.graph.autograd import OnnxModule, Precision, TracedGraph, graph_cache_from_env, trace_graph

__all__ = ["ExportedGraph", "export_graphs"]


@dataclass
class ExportedGraph:
    model: onnx.ModelProto
    traced: TracedGraph


def export_graphs(state: TrainerState, inputs: Sequence[torch.Tensor]) -> tuple[ExportedGraph, ExportedGraph]:
    """(training graph, eval graph) of the trainer's model for sample ``inputs`` (one per ``model_desc`` input);
    ValueError when a dim ``model_desc`` names cannot stay symbolic (an artifact is one graph for every size)."""
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
            exported = exported_graph(traced, cache, training, Precision())
        kept = {label for dims in traced.dynamic.values() for label in dims.values()}
        static = sorted({label for dims in axes.values() for label in dims.values()} - kept)
        if static:
            raise ValueError(
                f"the model's code makes the dims {static} static; a training artifact is one graph for every size of "
                "the dims model_desc names: give those dims as ints in model_desc (the ORTTrainer warning names the "
                "line that fixes them)"
            )
        graphs.append(ExportedGraph(exported, traced))
    return graphs[0], graphs[1]
