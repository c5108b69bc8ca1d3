"""A summed gradient accumulated term by term: ``acc(buf, Sum(a, b))`` -> ``acc(buf, a); acc(buf, b)``.

A weight used in several places (GPT-2's tied input embedding and output head, a layer shared by
ALBERT) gets one gradient term per use, and ONNX Runtime's gradient builder adds them with one ``Sum``
before the in-place accumulation into the gradient buffer. The ``Sum`` keeps every term alive until
the last one exists: GPT-2's head gradient (50257 x 768 floats, 154 MB at 124M) is made at the start
of the backward pass and waits for the embedding's (made at its very end), and the sum needs a third
tensor of that size. Accumulating each term into the buffer as soon as it exists frees it at once
(GPT-2 124M: the peak of a step drops by two such tensors).

The first accumulation keeps the original overwrite flag (the first micro-step of a window overwrites
the buffer); every later one adds, its flag being ``Not`` of the previous one's "updated" output (always
true), which also orders them. On the overwriting step the result is bit-identical to the ``Sum``
(``a + b`` either way); when adding into a buffer that holds earlier micro-steps the terms are added one
at a time, which may round differently in the last bit.
"""

from __future__ import annotations

import collections

import onnx
from onnx import helper

from ._onnx_util import NameMaker, replace_nodes

__all__ = ["split_summed_accumulations"]

_MS = "com.microsoft"


def split_summed_accumulations(model: onnx.ModelProto) -> int:
    """Rewrite every ``InPlaceAccumulatorV2(buf, Sum(...))`` of the training graph in place; returns how many."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    uses = collections.Counter(name for node in graph.node for name in node.input)
    uses.update(out.name for out in graph.output)
    targets = {}
    for node in graph.node:
        summed = producer.get(node.input[1]) if _is_accumulator(node) else None
        if summed is not None and summed.op_type == "Sum" and len(summed.input) > 1 and uses[summed.output[0]] == 1:
            targets[id(node)] = (summed, node)
    if not targets:
        return 0
    names = NameMaker(graph, "split_accumulation")
    chains = [_Chain(acc, list(summed.input), names) for summed, acc in targets.values()]
    dropped = {id(node) for pair in targets.values() for node in pair}
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for chain in chains:  # terms that are graph inputs are ready at once
        nodes += chain.ready(available)
    for node in graph.node:
        if id(node) in dropped:
            continue
        nodes.append(node)
        available.update(node.output)
        for chain in chains:  # each term is accumulated right after it is made, so it can be freed
            nodes += chain.ready(available)
    replace_nodes(graph, nodes)
    return len(chains)


class _Chain:
    """The accumulators replacing one ``acc(buf, Sum(terms))``; the last produces the original outputs."""

    def __init__(self, acc: onnx.NodeProto, terms: list[str], names: NameMaker):
        self._acc, self._terms, self._names = acc, terms, names
        self._flag = acc.input[2] if len(acc.input) > 2 else ""
        self._done = 0

    def ready(self, available: set[str]) -> list[onnx.NodeProto]:
        """The accumulators whose term exists now (in order: each waits for the previous one)."""
        nodes: list[onnx.NodeProto] = []
        buffer = self._acc.input[0]
        while self._done < len(self._terms) and self._terms[self._done] in available:
            index, term = self._done, self._terms[self._done]
            last = index == len(self._terms) - 1
            outputs = list(self._acc.output) if last else [self._names.new(f"{buffer}/updated_{index}")]
            inputs = [buffer, term, self._flag] if self._flag else [buffer, term]
            name = self._names.new(f"{buffer}/accumulate_{index}")
            nodes.append(helper.make_node("InPlaceAccumulatorV2", inputs, outputs, name=name, domain=_MS))
            if not last:  # the next term adds (never overwrites), after this one
                self._flag = self._names.new(f"{buffer}/add_{index + 1}")
                nodes.append(helper.make_node("Not", [outputs[0]], [self._flag], name=self._names.new("Not")))
            available.update(nodes[-1].output)
            self._done += 1
        return nodes


def _is_accumulator(node: onnx.NodeProto) -> bool:
    return node.op_type == "InPlaceAccumulatorV2" and node.domain == _MS and len(node.input) > 1
