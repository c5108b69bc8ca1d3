"""Random draws of a traced training graph (Dropout masks) as inputs the trainer fills, not ONNX ops.

ONNX Runtime's ``RandomUniformLike`` seeds its generator once, when the session is created, so a graph
that draws its own masks cannot be made to repeat a step after a resume. Each random op of the traced
graph (``bernoulli``, ``rand``, ``rand_like``, ``randn``, ``randn_like``) is replaced by a graph input of
the same shape that the session fills every step from a torch generator seeded with the step's seed
(``engine._random.step_seed``): uniform samples for ``bernoulli`` (``u < p``) and ``rand``, normal ones for
``randn``. Masks are then a function of (run seed, rank, step) only, on CPU and GPU alike.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str


def lift_random_ops(module: torch.fx.GraphModule) -> list[RandomInput]:
    """Replace the random ops of ``module`` by new trailing placeholders, in place; what each one needs."""
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    lifted: list[RandomInput] = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if target in _UNIFORM or target in _NORMAL or target in _BERNOULLI:
            value = node.meta["val"]
            kind = "normal" if target in _NORMAL else "uniform"
            spec = RandomInput(f"random.{len(lifted)}", tuple(int(d) for d in value.shape), value.dtype, kind)
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
