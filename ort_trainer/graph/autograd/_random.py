"""Random draws of a traced training graph (Dropout masks) as inputs the trainer fills, not ONNX ops.

ONNX Runtime's ``RandomUniformLike`` seeds its generator once, when the session is created, so a graph
that draws its own masks cannot be made to repeat a step after a resume. Each random op of the traced
graph (``bernoulli``, ``rand``, ``rand_like``, ``randn``, ``randn_like``) is replaced by a graph input of
the same shape that the session fills every step from a torch generator seeded with the step's seed
(``engine._random.step_seed``): uniform samples for ``bernoulli`` (``u < p``) and ``rand``, normal ones for
``randn``. Masks are then a function of (run seed, rank, step) only, on CPU and GPU alike.

``lift_random_ops(module, dropout_masks=True)`` (`ORTModule`'s graphs, from AOTAutograd) also lifts
``native_dropout``: its keep-mask becomes a bool input (kind ``"keep"``, with the keep probability) that
the caller fills as eager PyTorch's CPU Dropout draws it (``empty_like(x).bernoulli_(1 - p)`` from torch's
generator, with ``x``'s strides: the kernel fills memory in order), so the masks, and torch's RNG stream
after them, are eager's own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RandomInput", "lift_random_ops"]

_aten = torch.ops.aten
_UNIFORM = {_aten.rand.default, _aten.rand_like.default}
_NORMAL = {_aten.randn.default, _aten.randn_like.default}
_BERNOULLI = {_aten.bernoulli_.float, _aten.bernoulli.p, _aten.bernoulli.default}
_OTHER_RANDOM = ("random", "randint", "randperm", "multinomial", "normal", "uniform", "exponential", "poisson")


@dataclass(frozen=True)
class RandomInput:
    """A graph input that stands for a random op: filled with ``kind`` ("uniform" or "normal") samples."""

    name: str
    shape: tuple[int | str, ...]  # a str: an expression of symbolic dim names (`_symbolic.random_shape` sizes it)
    dtype: torch.dtype
    kind: str
    probability: float = 0.0  # kind "keep": the probability that an element is kept (1 - Dropout's p)
    stride: tuple[int | str, ...] | None = None  # kind "keep": the input's strides (eager fills its mask in order)


def lift_random_ops(
    module: torch.fx.GraphModule, *, dropout_masks: bool = False, size: Callable[[Any], int | str] = int
) -> list[RandomInput]:
    """Replace the random ops of ``module`` by new trailing placeholders, in place; what each one needs, in the
    order the graph draws them. ``dropout_masks``: ``native_dropout`` becomes a keep-mask input too. ``size``
    writes a traced size down (a symbolic trace's: an int or an expression of dim names, `_symbolic`)."""
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    lifted: list[RandomInput] = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if dropout_masks and target == _aten.native_dropout.default and _is_training_dropout(node):
            value = node.args[0].meta["val"]
            keep = 1.0 - float(node.args[1])
            shape, stride = tuple(size(d) for d in value.shape), tuple(size(s) for s in value.stride())
            spec = RandomInput(f"random.{len(lifted)}", shape, value.dtype, "keep", keep, stride)
            with graph.inserting_after(last) if last is not None else graph.inserting_before(None):
                mask = graph.placeholder(spec.name.replace(".", "_"))
            last = mask
            _replace_dropout(graph, node, mask, keep)
            lifted.append(spec)
        elif target in _UNIFORM or target in _NORMAL or target in _BERNOULLI:
            value = node.meta["val"]
            kind = "normal" if target in _NORMAL else "uniform"
            spec = RandomInput(f"random.{len(lifted)}", tuple(size(d) for d in value.shape), value.dtype, kind)
            with graph.inserting_after(last) if last is not None else graph.inserting_before(None):
                sample = graph.placeholder(spec.name.replace(".", "_"))  # a Python identifier; ONNX keeps spec.name
            last = sample
            replacement = sample if target not in _BERNOULLI else _bernoulli(graph, node, sample)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
            lifted.append(spec)
        elif getattr(target, "_overloadpacket", None) is not None and _is_other_random(str(target)):
            raise ValueError(
                f"the autograd engine cannot make {target} repeatable yet (only bernoulli/Dropout, rand and randn "
                "draws are fed from the step's seed); use options={'utils': {'engine': 'onnxblock'}}"
            )
    graph.eliminate_dead_code()
    module.recompile()
    return lifted


def _is_training_dropout(node: torch.fx.Node) -> bool:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is not False and 0.0 < float(node.args[1]) < 1.0


def _replace_dropout(graph: torch.fx.Graph, node: torch.fx.Node, mask: torch.fx.Node, keep: float) -> None:
    """``native_dropout(x, p)`` -> ``(x * (float(mask) * 1/keep), mask)``, its outputs taken by ``getitem``."""
    x = node.args[0]
    dtype = x.meta["val"].dtype
    with graph.inserting_after(node):
        as_float = graph.call_function(_aten._to_copy.default, (mask,), {"dtype": dtype})
    with graph.inserting_after(as_float):
        scaled = graph.call_function(_aten.mul.Tensor, (as_float, 1.0 / keep))
    with graph.inserting_after(scaled):
        result = graph.call_function(_aten.mul.Tensor, (x, scaled))
    result.meta["val"] = x.meta["val"]  # same shape and dtype as the input (read where it is a graph output)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(result if user.args[1] == 0 else mask)
            graph.erase_node(user)
    if node.users:
        raise ValueError(f"native_dropout {node.name} is used other than through its two outputs")
    graph.erase_node(node)


def _bernoulli(graph: torch.fx.Graph, node: torch.fx.Node, sample: torch.fx.Node) -> torch.fx.Node:
    """``bernoulli(p)`` as ``(u < p)`` in the op's dtype (``p`` a float argument, or the probabilities tensor)."""
    target, args = node.target, node.args
    if target == _aten.bernoulli.default:
        probability = args[0]
    else:
        probability = args[1] if len(args) > 1 else node.kwargs.get("p", 0.5)
    op = _aten.lt.Tensor if isinstance(probability, torch.fx.Node) else _aten.lt.Scalar
    with graph.inserting_after(node):
        below = graph.call_function(op, (sample, probability))
    with graph.inserting_after(below):
        return graph.call_function(_aten._to_copy.default, (below,), {"dtype": node.meta["val"].dtype})


def _is_other_random(name: str) -> bool:
    op = name.split(".")[1] if name.startswith("aten.") else ""
    return op.rstrip("_") in _OTHER_RANDOM or op.rstrip("_").endswith(("_normal", "_uniform"))
