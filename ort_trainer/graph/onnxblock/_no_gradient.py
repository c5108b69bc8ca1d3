"""Where torch records no gradient, the exported graph carries none; custom ``autograd.Function``s are refused.

The TorchScript exporter keeps only the forward: ``aten::detach`` exports as its input, ops under
``torch.no_grad()`` export like any other (a trace does not record grad mode), an ``autograd.Function``
exports as the ops of its ``forward`` (its ``backward`` is lost). ONNX Runtime then differentiated them all:
torch gave ``first.weight`` no gradient through ``first(x).detach()``, ONNX Runtime did. Here:

* The trace runs with autograd recording (`traced_gradients`; the activations it would save for a backward
  are dropped by saved-tensor hooks, so memory stays as under ``no_grad``), so grad mode is the user's: a
  torch function called while it is off (``torch.no_grad()``, ``inference_mode``) whose float result tracks
  no gradient although one of its inputs does gets its result detached (a ``TorchFunctionMode``), which the
  trace records as ``aten::detach``, as it records the model's own ``detach()`` calls. (Not the traced
  graph's value types: they miss ``requires_grad`` on some ops, convolutions among them.)
* While our export runs, ``aten::detach`` of a float tensor exports as `no_gradient_copy`: the tensor, flat,
  read through the running mean of a ``BatchNormalization`` in training mode with momentum 1: ``mean * 1 +
  batch_mean * 0`` with ``batch_mean = -1``, the mean bit for bit (``-0.0`` too). ONNX Runtime's gradient builder
  never differentiates that input. `seal_no_gradient_copies` then makes the node ``com.microsoft``
  ``BatchNormInternal`` (same kernel and stop-gradient inputs): onnxblock switches every ``BatchNormalization`` of
  the eval graph to inference mode, which has no running-mean output. ``save_as_onnx`` writes each copy as
  ``Identity`` (`unseal_no_gradient_copies`): inference builds of onnxruntime have no training ops.
* A ``prim::PythonOp`` (an ``autograd.Function``), found right after the exporter inlines the trace, is
  refused with `UnsupportedBackwardError`, naming it: its ``backward`` may be anything (a gradient scale or
  reversal) and the graph would differentiate its forward. Let through: a Function with a ``symbolic``
  (the model says how it exports: `ort_trainer.parallel`'s Megatron markers) and ``torch.utils.checkpoint``'s,
  whose backward is its forward's derivative.

Cost: a copy reads and writes the tensor a few times (flat constants of its size); ``detach`` and ``no_grad``
are rare in a training forward, and the padding row of `_embedding` is one row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx
import torch
import torch.utils.checkpoint
from torch.onnx import symbolic_helper as sh

from ort_trainer.runtime import NO_GRADIENT_NODE_SUFFIX

__all__ = [
    "UnsupportedBackwardError",
    "detach_symbolic",
    "no_gradient_copy",
    "seal_no_gradient_copies",
    "traced_gradients",
    "unseal_no_gradient_copies",
]

_EPS = 2.0**-16  # with momentum 1: the signature `seal_no_gradient_copies` looks for (eps changes no value here)
_MS_DOMAIN = "com.microsoft"
_FLOAT_SCALARS = {"Float", "Double", "Half", "BFloat16"}
# Functions whose results never depend on their inputs' values (nothing to detach), and detach itself.
_VALUE_FREE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.detach, torch.Tensor.detach, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_empty, torch.Tensor.new_full,
}  # fmt: skip
_active = False


class UnsupportedBackwardError(TypeError):
    """The model computes something whose backward a traced graph cannot give (raised while tracing)."""


@contextlib.contextmanager
def traced_gradients() -> Iterator[None]:
    """For one export: trace with autograd recording (nothing saved), mark where torch records no gradient.

    Also turns on `detach_symbolic` (and `_embedding`'s padding rows): outside our export, the user's own
    ``torch.onnx.export`` calls get torch's symbolics.
    """
    global _active
    real_inline = torch._C._jit_pass_inline

    def inline_then_check(graph):
        real_inline(graph)
        _refuse_autograd_functions(graph)

    previous, _active = _active, True
    torch._C._jit_pass_inline = inline_then_check
    try:
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked),
            _DetachWhereGradIsOff(),
        ):
            yield
    finally:
        torch._C._jit_pass_inline = real_inline
        _active = previous


def active() -> bool:
    """Whether our export is running (the symbolics of this package change the graph only then)."""
    return _active


def _drop(tensor: torch.Tensor) -> None:
    return None  # the traced forward's activations: no backward runs on them


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("ort_trainer traced this forward for export only; it has no backward")


def _refuse_autograd_functions(graph) -> None:
    for node in _nodes(graph.block()):
        if node.kind() != "prim::PythonOp":
            continue
        function = getattr(node.pyobj(), "__self__", None)
        if function is torch.utils.checkpoint.CheckpointFunction or callable(getattr(function, "symbolic", None)):
            continue
        name = getattr(function, "__qualname__", None) or node.pyname()
        module = getattr(function, "__module__", "")
        raise UnsupportedBackwardError(
            f"the model calls the torch.autograd.Function {module + '.' if module else ''}{name}: ORTTrainer builds "
            "gradients from the traced forward, so the Function's own backward would be ignored (a gradient scale "
            "or reversal would silently be lost). Write it with plain torch operations if its backward is its "
            "forward's derivative, give the Function a `symbolic` staticmethod that exports what the graph should "
            "differentiate, or train it with the autograd engine (options.utils.engine='autograd')"
        )


def _nodes(block) -> Iterator:
    for node in block.nodes():
        yield node
        for inner in node.blocks():
            yield from _nodes(inner)


class _DetachWhereGradIsOff(torch.overrides.TorchFunctionMode):
    """Detach what a torch function returns with grad mode off, where an input tracks a gradient (see above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() or func in _VALUE_FREE or not _any_tracked((args, kwargs)):
            return result
        return torch.utils._pytree.tree_map_only(torch.Tensor, _detached, result)


def _any_tracked(tree) -> bool:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad for x in leaves)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() and not tensor.requires_grad:
        return tensor.detach()  # recorded by the trace: exported as a copy without a gradient
    return tensor


def _is_float_tensor(value) -> bool:
    kind = value.type()
    return isinstance(kind, torch._C.TensorType) and kind.scalarType() in _FLOAT_SCALARS


@sh.parse_args("v")
def _detach(g, x):
    known = x.type().kind() == "TensorType" and x.type().scalarType() is not None
    return no_gradient_copy(g, x) if _active and (_is_float_tensor(x) or not known) else x


def detach_symbolic():
    """The ``aten::detach`` symbolic registered by `_symbolics` (torch's: the input itself)."""
    return _detach


def no_gradient_copy(g, x):
    """``x``'s values through an input the gradient builder never differentiates (module docstring)."""
    dtype = x.type().dtype() if x.type().scalarType() else torch.float32
    flat = g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([-1])))
    channels = g.op("Shape", flat)

    def filled(value: float, shape):
        return g.op("ConstantOfShape", shape, value_t=torch.tensor([value], dtype=dtype))

    minus_ones = filled(-1.0, g.op("Concat", g.op("Constant", value_t=torch.tensor([1])), channels, axis_i=0))
    _, copy, _ = g.op(
        "BatchNormalization", minus_ones, filled(1.0, channels), filled(0.0, channels), flat, filled(1.0, channels),
        epsilon_f=_EPS, momentum_f=1.0, training_mode_i=1, outputs=3,
    )  # fmt: skip
    return g.op("Reshape", copy, g.op("Shape", x))


def seal_no_gradient_copies(model: onnx.ModelProto) -> int:
    """Make each `no_gradient_copy` a ``com.microsoft`` ``BatchNormInternal``; returns how many. In place.

    ONNX's shape inference does not know that op: its running-mean output gets the mean's type as
    ``value_info`` (rank 1), so the types of what follows stay known (the CPU rewrites need them). A node that
    reads a state tensor straight into a copy (the padding row's ``Gather``, a detached weight's ``Reshape``)
    is a consumer of a trained weight that no gradient reaches, by design: it is named with
    `NO_GRADIENT_NODE_SUFFIX`, which keeps ONNX Runtime's warning about it out of the log.
    """
    copies = [n for n in model.graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]
    copies = [n for n in copies if _is_copy(n)]
    if not copies:
        return 0
    elem_types = _elem_types(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    state = {init.name for init in model.graph.initializer}
    known = {info.name for info in model.graph.value_info}
    for node in copies:
        node.op_type, node.domain = "BatchNormInternal", _MS_DOMAIN
        while len(node.output) < 5:  # saved mean and inverse std, unused
            node.output.append(f"{node.output[0]}.unused_{len(node.output)}")
        if node.output[1] not in known:
            elem = elem_types.get(node.input[3], onnx.TensorProto.FLOAT)
            model.graph.value_info.append(onnx.helper.make_tensor_value_info(node.output[1], elem, [None]))
        flat = producers.get(node.input[3])
        for reader in (flat, producers.get(flat.input[0]) if flat is not None else None):
            if reader is not None and state.intersection(reader.input):
                if not reader.name.endswith(NO_GRADIENT_NODE_SUFFIX):
                    reader.name = f"{reader.name or reader.op_type}{NO_GRADIENT_NODE_SUFFIX}"
                break
    if not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(_MS_DOMAIN, 1))
    return len(copies)


def unseal_no_gradient_copies(model: onnx.ModelProto) -> int:
    """Each sealed copy becomes ``Identity`` (an inference graph needs no stop-gradient); returns how many.

    In place, for graphs handed to plain ``onnxruntime`` (``save_as_onnx``): ``BatchNormInternal`` is an
    onnxruntime-training op, which inference builds do not have. The constants that fed it are dropped.
    """
    graph = model.graph
    copies = [n for n in graph.node if n.op_type == "BatchNormInternal" and n.domain == _MS_DOMAIN and _is_copy(n)]
    for node in copies:
        mean, value = node.input[3], node.output[1]
        del node.input[:], node.output[:], node.attribute[:]
        node.op_type, node.domain = "Identity", ""
        node.input.append(mean)
        node.output.append(value)
    if copies:
        _drop_unused_nodes(graph)
    return len(copies)


def _drop_unused_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs anything reads (repeatedly: their inputs' producers may follow)."""
    while True:
        read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        kept = [node for node in graph.node if any(out in read for out in node.output if out)]
        if len(kept) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(kept)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """{tensor: element type} from ONNX shape inference (empty where it fails, e.g. a > 2 GB model)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - the value_info is a help to later passes, not needed for correctness
        return {}
    infos = [*graph.input, *graph.value_info, *graph.output]
    return {i.name: i.type.tensor_type.elem_type for i in infos if i.type.tensor_type.elem_type}


def _is_copy(node: onnx.NodeProto) -> bool:
    """Our signature: training mode, momentum 1 (the running mean passes through), epsilon `_EPS`."""
    values = {a.name: (a.i if a.type == onnx.AttributeProto.INT else a.f) for a in node.attribute}
    return (
        len(node.input) == 5
        and values.get("training_mode") == 1
        and values.get("momentum") == 1.0
        and values.get("epsilon") == _EPS
    )
