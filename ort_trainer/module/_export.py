"""Exporting one of `OrtGraph`'s graphs: through the graph cache, errors told in ORTModule's terms.

`exported` takes the ONNX model from the on-disk graph cache (`graph.autograd.GraphCache`) or exports it with the
autograd engine's exporter (`graph.autograd.graph_to_onnx`); an op without an ONNX translation is named with the
user's line that calls it and the ways out; `SymbolicShapesError` passes as it is (the backend then exports the
graph per shape). `folded_outputs` spots a graph the exporter folded to constants.
"""

from __future__ import annotations

import logging
import re

import onnx
import torch
from onnx import numpy_helper

from ort_trainer.graph.autograd import (
    GraphCache,
    SymbolicShapesError,
    TracedGraph,
    TraceError,
    build_in_child,
    export_in_child,
    get_or_build,
    graph_to_onnx,
)

__all__ = ["exported", "folded_outputs"]

_log = logging.getLogger("ort_trainer")


def _to_onnx(traced: TracedGraph, kind: str) -> onnx.ModelProto:
    """`graph_to_onnx`, its error told in ORTModule's terms: the op, the user's line that calls it, the ways out."""
    try:
        return graph_to_onnx(traced)
    except SymbolicShapesError:  # the caller exports it per shape
        raise
    except TraceError as error:
        ops = re.findall(r"no ONNX translation for ([\w., ]+)\)", str(error))
        names = [o.strip() for o in ops[0].split(",")] if ops else []
        where = _lines_calling(traced.module, names)
        what = f"no ONNX translation for {', '.join(names)}" if names else str(error).split(". An aten op")[0]
        raise TraceError(
            f"ORTModule could not export the {kind} graph ({what}){f', called at {where}' if where else ''}. "
            "Give the op an ONNX translation with onnxscript, compute it with other ops, or move the call into a "
            "function decorated with @torch.compiler.disable and use torch.compile(module, backend='ort_trainer') "
            "(that call then runs in eager PyTorch, the rest in ONNX Runtime: docs/ortmodule.md)"
        ) from error


def _lines_calling(module: torch.fx.GraphModule, ops: list[str]) -> str:
    """``file:line`` of the user's code behind the first node that calls one of ``ops`` (Dynamo's stack traces)."""
    for node in module.graph.nodes:
        if node.op == "call_function" and any(str(node.target).startswith(op + ".") for op in ops):
            found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
            if found:
                return f"{found[-1][0]}:{found[-1][1]}"
    return ""


def exported(traced: TracedGraph, cache: GraphCache | None, kind: str) -> onnx.ModelProto:
    """``traced`` as an ONNX model, from the graph cache when it holds it (``cache`` None: no cache)."""

    def build() -> onnx.ModelProto:
        if export_in_child(traced.sample_args):
            return build_in_child(lambda: _to_onnx(traced, kind), f"ORTModule {kind}")
        return _to_onnx(traced, kind)

    model, hit = get_or_build(cache, traced, {"ortmodule": kind}, build)
    if hit:
        _log.info("graph cache: ORTModule %s graph loaded from %s", kind, cache.directory)
    return model


def folded_outputs(model: onnx.ModelProto, device: torch.device) -> list[torch.Tensor] | None:
    """The outputs of a graph without nodes (every output an initializer), else None."""
    if model.graph.node:
        return None
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    missing = [o.name for o in model.graph.output if o.name not in values]
    if missing:
        raise TraceError(f"the exported graph has no nodes and no values for its outputs {missing}")
    return [torch.from_numpy(values[o.name].copy()).to(device) for o in model.graph.output]
