"""`missing_kernel_error`: ONNX Runtime's refusal to load a graph for want of a kernel of the graph's dtype, told as
what it is (the op, the dtype, the provider, the way out) rather than as a fault of the exporter.

A float64 model (GELU's ``Erf``, ``Conv``) or a ``torch.autocast(dtype=torch.bfloat16)`` forward (``MatMul``,
``Gemm``) exports fine, but ONNX Runtime's CPU execution provider registers no kernel of that type for some of its
ops, and the session fails to start with NOT_IMPLEMENTED "Could not find an implementation for Erf(13) node with
name 'node_Erf_2'" (older runtimes: "Failed to find kernel for ... the node in the model has the following type
(tensor(double))", also for a node ONNX Runtime's own optimizer fused), or, where ONNX's schema itself takes no
such type, with INVALID_GRAPH "Type Error: Type 'tensor(bfloat16)' of input parameter (x) of operator (Conv) in
node (node_convolution) is invalid".
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto

from ._trace import TraceError

__all__ = ["UnsupportedDtypeError", "missing_kernel_error", "output_dtype_error"]

_NOT_IMPLEMENTED = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
_INVALID_TYPE = re.compile(
    r"Type '(tensor\((\w+)\))' of input parameter \(([^)]*)\) of operator \((\w+)\) in node \(([^)]*)\) is invalid"
)
# older runtimes (onnxruntime-training 1.19.2), and nodes its own optimizer made (a float-only com.microsoft.FusedMatMul
# from a float64 MatMul): "Failed to find kernel for <op>(<opset>) (node:'<name>' ...) ... the node in the model has
# the following type (tensor(double))"
_NO_KERNEL_OF_TYPE = re.compile(
    r"Failed to find kernel for ([\w.]+)\((\d+)\) \(node:'([^']*)'.*?the node in the model has the following type "
    r"\(tensor\((\w+)\)\)",
    re.DOTALL,
)
# ONNX element types as torch names them (the names a user wrote: model.double(), autocast's dtype)
_TORCH_NAMES = {
    TensorProto.DOUBLE: "float64",
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
}
# the dtypes whose kernels a provider may lack where it has float32's: the float32 way out applies
_NARROW_OR_WIDE = frozenset({"float64", "float16", "bfloat16"})
_ONNX_NAMES = {"double": "float64", "float": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class UnsupportedDtypeError(TraceError, TypeError):
    """A graph ONNX Runtime cannot run as PyTorch does in its dtype (no kernel or ONNX type of that dtype, or an op
    exported in another dtype): a TypeError (the dtype is the cause) that is also the `TraceError` the callers of
    a graph build already catch."""


def missing_kernel_error(
    error: BaseException, model: onnx.ModelProto, provider: str, what: str
) -> UnsupportedDtypeError | None:
    """``error`` (ONNX Runtime's session load failure for ``model`` on ``provider``) as an `UnsupportedDtypeError`
    naming the op, its opset, the input dtype and the way out; None when the failure is something else (an op
    missing whatever the dtype: a float32 node, or one whose dtype the graph does not say).

    ``what`` names the graph in the message ("the exported forward graph")."""
    text = str(error)
    found = _NOT_IMPLEMENTED.search(text)
    if found is not None:
        op, opset, node_name = found.groups()
        dtype = _input_dtype(model, node_name, op)
        kernel = f"has no kernel for {op} (opset {opset})" + (f" with {dtype} inputs" if dtype else "")
    elif (found := _NO_KERNEL_OF_TYPE.search(text)) is not None:
        op, opset, node_name, onnx_type = found.groups()
        dtype = _ONNX_NAMES.get(onnx_type, onnx_type)
        kernel = f"has no kernel for {op} (opset {opset}) with {dtype} inputs"
    else:
        found = _INVALID_TYPE.search(text)
        if found is None:
            return None
        _, onnx_type, _, op, node_name = found.groups()
        dtype = _ONNX_NAMES.get(onnx_type, onnx_type)
        kernel = f"has no kernel for {op} with {dtype} inputs (ONNX's {op} takes no {dtype})"
    if dtype not in _NARROW_OR_WIDE:  # float32 (or unknown): a missing op, not a dtype; the caller's message
        return None
    return UnsupportedDtypeError(
        f"ONNX Runtime {ort.__version__}'s {_short(provider)} execution provider {kernel}: node '{node_name}' of "
        f"{what} cannot run there. {_way_out(dtype)}"
    )


def output_dtype_error(
    model: onnx.ModelProto, traced: Mapping[str, torch.dtype], what: str
) -> UnsupportedDtypeError | None:
    """An `UnsupportedDtypeError` for the first floating-point output of ``model`` whose ONNX dtype is not the one
    PyTorch traced for it (``traced``: output name to dtype), naming the node that computes it; None if all match.

    ONNX Runtime would hand the next graph (the backward) tensors of another dtype than it was built for, or the
    user values of another precision than eager's: the exporter's translation of that op does not keep the dtype
    (LayerNormalization's mean and 1/std stay float32 for a float64 input)."""
    for output in model.graph.output:
        dtype = traced.get(output.name)
        elem = output.type.tensor_type.elem_type
        if (
            dtype is None
            or not dtype.is_floating_point
            or elem not in _TORCH_NAMES
            or _TORCH_NAMES[elem] == _name(dtype)
        ):
            continue
        node = next((n for n in model.graph.node if output.name in n.output), None)
        where = f"node '{node.name}' ({node.op_type})" if node is not None else f"output '{output.name}'"
        return UnsupportedDtypeError(
            f"{what} computes {where} in {_TORCH_NAMES[elem]} where PyTorch computes {_name(dtype)}: the ONNX "
            f"translation of that op does not keep {_name(dtype)}, so ONNX Runtime would not compute as PyTorch "
            f"does. {_way_out(_name(dtype))}"
        )
    return None


def _name(dtype: torch.dtype) -> str:
    """``torch.float64`` as "float64"."""
    return str(dtype).removeprefix("torch.")


def _way_out(dtype: str | None) -> str:
    if dtype in ("bfloat16", "float16"):
        return (
            f"The model computes in {dtype} under torch.autocast: drop the torch.autocast(..., dtype=torch.{dtype}) "
            "around the call so that it computes in float32, or run on a device whose provider has these kernels"
        )
    if dtype == "float64":
        return "Train in float32: model.float() and float32 inputs"
    return "Train in float32 (model.float(), float32 inputs, no torch.autocast around the call)"


def _short(provider: str) -> str:
    """``CPUExecutionProvider`` as ``CPU``."""
    return provider.removesuffix("ExecutionProvider") or provider


def _input_dtype(model: onnx.ModelProto, node_name: str, op: str) -> str | None:
    """The torch name of the first typed input's dtype of the node named ``node_name`` (or, for a node ONNX
    Runtime's fusions renamed, ``node_addmm/GemmTransposeFusion/``, of the node it came from, else the first
    ``op`` node); None when the graph does not say."""
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    node = nodes.get(node_name) or nodes.get(node_name.split("/")[0])
    if node is None:
        node = next((n for n in graph.node if n.op_type == op), None)
    if node is None:
        return None
    types = _value_types(graph)
    if not any(name in types for name in node.input if name):
        types = _value_types(onnx.shape_inference.infer_shapes(model).graph)
    for name in node.input:
        elem = types.get(name)
        if elem:
            return _TORCH_NAMES.get(elem, TensorProto.DataType.Name(elem).lower())
    return None


def _value_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    return {name: elem for name, elem in types.items() if elem}
