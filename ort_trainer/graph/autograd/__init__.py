"""Training graphs from PyTorch's own autograd, for the stock ``onnxruntime`` (the ``autograd`` engine).

The onnxblock engine exports the forward graph and lets ONNX Runtime's C++ gradient builder write the
backward. This package instead asks PyTorch for both: the forward and its backward are traced together
as one aten graph (``make_fx`` over ``torch.autograd.grad``, in fake mode, with PyTorch's decompositions),
and that joint graph is exported with the dynamo ONNX exporter into standard ONNX ops only. Any
``onnxruntime`` runs it, and its gradients are PyTorch's formulas (``padding_idx`` and friends included).

* ``_decompositions``: the aten decompositions the graphs are traced with, and why each is needed; ``_gelu``: the
  exact GELU and its backward written with one shared ``erf`` (the export computes it once);
* ``_trace``: `trace_graph`, the joint (training) or forward-only (eval) aten graph of a module + loss;
* ``_precision``: `Precision`, mixed precision as PyTorch's (traced under ``torch.autocast``, the backward from
  ``loss * loss_scale``);
* ``_to_onnx``: `graph_to_onnx`, the dynamo exporter over a traced graph, named inputs and outputs;
* ``_onnx_passes``: the exported graph made cheaper for ORT to hold and run (`collapse_layout_chains`,
  `fold_zero_scatter_adds`, `fold_one_hot_loss_gradients`, run by `graph_to_onnx`), and the ORT optimizers
  its sessions leave out (`DISABLED_ORT_OPTIMIZERS`);
* ``_onnx_module``: `OnnxModule`, a user-given ``onnx.ModelProto`` as a torch module (its float initializers as
  parameters under their ONNX names), so that the same trace trains it; `onnx_model_problems` names what has no
  route; ``_onnx_ops`` / ``_onnx_nn_ops``: its standard ops as torch ops, over ``_onnx_node``'s `OnnxNode`;
* ``_random``: `lift_random_ops`, random draws (Dropout masks) as graph inputs filled by torch;
* ``_symbolic``: symbolic dims, one graph for every size of the input dims ``model_desc`` names (the symbolic
  trace's fake inputs, its dim classes, the exporter's ``dynamic_shapes``, random draws sized per batch);
* ``_kernels``: `missing_kernel_error`, ONNX Runtime's refusal to load a graph for want of a kernel of its dtype
  (float64, bfloat16 on CPU) told as that (`UnsupportedDtypeError`, a TypeError), not as an exporter fault, and
  `output_dtype_error`, an export that computes an output in another dtype than PyTorch's;
* ``_labels``: `class_index_inputs`, the graph inputs that reach a cross-entropy / NLL loss as class indices (checked
  before a run: ONNX's gather would take a negative label from the end);
* ``_cache``: `GraphCache`, the on-disk cache of exported graphs keyed by graph structure and versions (a trace's
  `TracedGraph.fingerprint`): a hit skips the export and its passes; `get_or_build`, the one way the trainer's
  engine and ORTModule use it;
* ``_child_export``: `build_in_child`, an export in a forked child process (its memory never joins the training
  process's; the engine's trace runs there too), and `export_in_child`, when to ask for one
  (``ORT_TRAINER_EXPORT_IN_CHILD``, large graphs by default).
"""

from __future__ import annotations

from ._cache import GraphCache, get_or_build, graph_cache_from_env
from ._child_export import build_in_child, export_in_child
from ._decompositions import training_decompositions
from ._kernels import UnsupportedDtypeError, missing_kernel_error, output_dtype_error
from ._labels import ClassIndexInput, class_index_inputs
from ._onnx_module import OnnxModule, onnx_model_problems
from ._onnx_passes import DISABLED_ORT_OPTIMIZERS, collapse_layout_chains, fold_zero_scatter_adds
from ._precision import LOSS_SCALE_INPUT, Precision
from ._random import RandomInput, lift_random_ops
from ._symbolic import broken_guard, random_shape, signature_shape
from ._to_onnx import graph_to_onnx
from ._trace import GRAD_SUFFIX, UPDATED_SUFFIX, GraphNames, SymbolicShapesError, TracedGraph, TraceError, trace_graph

__all__ = [
    "DISABLED_ORT_OPTIMIZERS",
    "GRAD_SUFFIX",
    "LOSS_SCALE_INPUT",
    "UPDATED_SUFFIX",
    "ClassIndexInput",
    "GraphCache",
    "GraphNames",
    "OnnxModule",
    "Precision",
    "RandomInput",
    "SymbolicShapesError",
    "TraceError",
    "TracedGraph",
    "UnsupportedDtypeError",
    "broken_guard",
    "build_in_child",
    "class_index_inputs",
    "collapse_layout_chains",
    "export_in_child",
    "fold_zero_scatter_adds",
    "get_or_build",
    "graph_cache_from_env",
    "graph_to_onnx",
    "lift_random_ops",
    "missing_kernel_error",
    "onnx_model_problems",
    "output_dtype_error",
    "random_shape",
    "signature_shape",
    "trace_graph",
    "training_decompositions",
]
