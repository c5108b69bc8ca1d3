"""Gradients as plain graph outputs instead of onnxblock's ``InPlaceAccumulatorV2`` nodes.

onnxblock ends every gradient in ``InPlaceAccumulatorV2(buffer, grad, lazy_reset_grad)``: on a step that
starts an accumulation cycle (every step, without gradient accumulation) it *copies* the gradient ONNX
Runtime computed in its own arena into the bound buffer; otherwise it adds. The copy is a full extra
pass over all gradients (GPT-2 124M: 124M floats read and written, ~4% of a 1-thread step, measured
with `benchmarks/profile_step.py`), and the arena holds a second copy of every gradient meanwhile.

After this rewrite each gradient ``<param>_grad`` is a graph output; the session binds it to the
gradient buffer's view once, and ONNX Runtime's kernel writes the gradient straight into it (ORT uses a
bound output's memory as the producing node's output). Steps that accumulate bind those outputs to
memory ONNX Runtime allocates and add them into the buffers with torch, on the buffers' device.
"""

from __future__ import annotations

import onnx

__all__ = ["ACCUMULATOR_SUFFIX", "gradients_as_outputs"]

ACCUMULATOR_SUFFIX = ".accumulation.buffer"  # onnxblock names the buffer input "<param>_grad.accumulation.buffer"
_LAZY_RESET = "lazy_reset_grad"


def gradients_as_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Remove the ``InPlaceAccumulatorV2`` nodes of an onnxblock training graph, in place.

    Each accumulator's gradient becomes a graph output (typed like its buffer input, which is removed
    with the accumulator's flag output); ``lazy_reset_grad`` goes when nothing reads it any more.
    Returns ``{buffer input name: gradient output name}`` for the accumulators removed (empty: the
    graph had none, e.g. it was already rewritten).
    """
    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name for o in graph.output}
    removed: dict[str, str] = {}
    flags: set[str] = set()
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        if not _is_accumulator(node, inputs, outputs):
            kept.append(node)
            continue
        buffer, grad = node.input[0], node.input[1]
        removed[buffer] = grad
        flags.add(node.output[0])
    if not removed:
        return {}
    new_outputs = [o for o in graph.output if o.name not in flags]
    for buffer, grad in removed.items():
        info = onnx.ValueInfoProto()
        info.CopyFrom(inputs[buffer])
        info.name = grad
        new_outputs.append(info)
    del graph.output[:]
    graph.output.extend(new_outputs)
    del graph.node[:]
    graph.node.extend(kept)
    still_read = {name for node in kept for name in node.input}
    gone = set(removed) | ({_LAZY_RESET} - still_read)
    new_inputs = [i for i in graph.input if i.name not in gone]
    del graph.input[:]
    graph.input.extend(new_inputs)
    return removed


def _is_accumulator(node: onnx.NodeProto, inputs: dict, outputs: set[str]) -> bool:
    return (
        node.op_type == "InPlaceAccumulatorV2"
        and node.domain == "com.microsoft"
        and len(node.input) == 3
        and node.input[0] in inputs
        and node.input[0].endswith(ACCUMULATOR_SUFFIX)
        and node.input[1] not in outputs
        and node.input[1] not in inputs
        and len(node.output) == 1
        and node.output[0] in outputs
    )
