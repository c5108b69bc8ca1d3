"""CPU speed (and memory) rewrites: each keeps the math (loss and gradients equal PyTorch's), one module per rewrite.

* Forward graph, before gradient building (`apply_forward_rewrites`, CPU only): `gather_to_gather_nd`,
  `decompose_softmax_cross_entropy`: faster CPU kernels for the same values.
* Training graph, after gradient building (`apply_training_rewrites`, CPU only): `decompose_gelu_grads`,
  `decompose_relu_grads`, `decompose_layer_norm_grads`: vectorised, multi-threaded element-wise ops
  instead of single-threaded gradient kernels; `split_summed_accumulations`: a weight's gradient terms
  (tied or shared weights) accumulated one by one as they are made, instead of summed at the end (memory).

Modules: ``_gather_nd``, ``_cross_entropy`` (forward); ``_gelu_grad``, ``_relu_grad``, ``_layer_norm_grad``,
``_split_accumulation`` (training graph); ``_onnx_util``: the small helpers they share.

tests/onnxblock/ (test_graph_rewrites.py, test_graph_gelu.py, test_graph_relu.py, ...) checks each one against
PyTorch.
"""

from __future__ import annotations

import onnx

from ._cross_entropy import decompose_softmax_cross_entropy
from ._gather_nd import gather_to_gather_nd
from ._gelu_grad import decompose_gelu_grads
from ._layer_norm_grad import decompose_layer_norm_grads
from ._relu_grad import decompose_relu_grads
from ._split_accumulation import split_summed_accumulations

__all__ = [
    "apply_forward_rewrites",
    "apply_training_rewrites",
    "decompose_gelu_grads",
    "decompose_layer_norm_grads",
    "decompose_relu_grads",
    "decompose_softmax_cross_entropy",
    "gather_to_gather_nd",
    "split_summed_accumulations",
]


def apply_forward_rewrites(model: onnx.ModelProto) -> int:
    """The CPU speed rewrites of the forward graph, in place; returns the number of nodes replaced."""
    return gather_to_gather_nd(model) + decompose_softmax_cross_entropy(model)


def apply_training_rewrites(model: onnx.ModelProto, threads: int = 0) -> int:
    """The CPU speed rewrites of the training (gradient) graph, in place; returns the number of nodes replaced.

    ``threads``: ORT's intra-op threads (0: unknown, taken as several). On one thread the exact GELU
    gradient kernel beats its element-wise form, so it is kept (`decompose_gelu_grads`).
    """
    gelu = decompose_gelu_grads(model, exact=threads != 1)
    kernels = gelu + decompose_relu_grads(model) + decompose_layer_norm_grads(model)
    return kernels + split_summed_accumulations(model)
