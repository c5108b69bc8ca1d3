"""`class_index_inputs`: the graph inputs that reach a cross-entropy / NLL loss as class indices.

``cross_entropy`` and ``nll_loss`` reach a traced graph as PyTorch's decomposition: the label, with its
``ignore_index`` entries replaced by 0 (``where(ne(label, ignore_index), label, 0)``), gathers one log-probability
per row. ONNX's gather takes a negative index from the end, so a label of -1 would silently train the last class
where eager PyTorch raises "Target -1 is out of bounds": the trainers check these inputs before a run
(`diagnosis.check_labels`). Found by that pattern only, so a model's own gather on an index input is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ClassIndexInput", "class_index_inputs"]

_aten = torch.ops.aten
# what may stand between the graph input and the loss's use of it (the label flattened for a language model)
_VIEWS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.squeeze.default,
    _aten.unsqueeze.default,
    _aten.alias.default,
    _aten.clone.default,
}


@dataclass(frozen=True)
class ClassIndexInput:
    """A graph input (its placeholder's position) that a loss reads as class indices."""

    position: int
    classes: int | None  # None: a symbolic class dim (not checked)
    ignore_index: int


def class_index_inputs(module: torch.fx.GraphModule) -> list[ClassIndexInput]:
    """Each placeholder that a decomposed ``nll_loss`` reads as its target, with the number of classes and the
    ``ignore_index``; in placeholder order, once each (the first loss that reads it)."""
    positions = {node: i for i, node in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
    found: dict[int, ClassIndexInput] = {}
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target is not _aten.gather.default or len(node.args) < 3:
            continue
        source, dim, index = node.args[:3]
        if not isinstance(index, torch.fx.Node) or not isinstance(source, torch.fx.Node) or not isinstance(dim, int):
            continue
        masked = _unviewed(index)
        label, ignore_index = _masked_label(masked)
        if label is None:
            continue
        position = positions.get(_unviewed(label))
        if position is None or position in found:
            continue
        value = source.meta.get("val")
        classes = value.shape[dim] if isinstance(value, torch.Tensor) and value.dim() > dim else None
        found[position] = ClassIndexInput(position, classes if isinstance(classes, int) else None, ignore_index)
    return [found[p] for p in sorted(found)]


def _unviewed(node: torch.fx.Node) -> torch.fx.Node:
    while (
        node.op == "call_function" and node.target in _VIEWS and node.args and isinstance(node.args[0], torch.fx.Node)
    ):
        node = node.args[0]
    return node


def _masked_label(node: torch.fx.Node) -> tuple[torch.fx.Node | None, int]:
    """``where(ne(label, ignore_index), label, 0)`` -> (label, ignore_index); (None, 0) for anything else."""
    if node.op != "call_function" or node.target is not _aten.where.self or len(node.args) != 3:
        return None, 0
    condition, label, _ = node.args
    if not isinstance(condition, torch.fx.Node) or condition.target is not _aten.ne.Scalar:
        return None, 0
    compared, ignore_index = condition.args[:2]
    if compared is not label or not isinstance(ignore_index, int) or not isinstance(label, torch.fx.Node):
        return None, 0
    return label, ignore_index
