"""`ort_backend`: the ``torch.compile`` backend ``"ort_trainer"``: AOTAutograd graphs run in ONNX Runtime.

Dynamo hands over an FX graph of torch calls. AOTAutograd (``torch._dynamo.backends.common.aot_autograd``)
traces it below autograd with the autograd engine's decompositions (`training_decompositions`: without the
core aten ones the exporter's ``nll_loss_backward`` drops the mean), functionalises it and splits the joint
graph with ``default_partition``: the forward saves every activation the backward reads and the backward
recomputes nothing; a saved view is saved as its base (`_partition`). Each of the forward, backward and
inference (no-grad) graphs is exported to ONNX and run in ONNX Runtime (`OrtGraph`); AOTAutograd's runtime
wraps them in a ``torch.autograd.Function``, so gradients arrive in ``param.grad`` through torch's own autograd
(hooks, DDP buckets and accumulation included). A graph with symbolic sizes is one ORT graph for every size;
one the exporter refuses with them runs as one graph per shape (`PerShapeGraphs`), said once.

Registered with torch through the ``torch_dynamo_backends`` entry point (setup.py), so that
``torch.compile(model, backend="ort_trainer")`` needs no import of ours.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from torch.nn.attention import SDPBackend, sdpa_kernel

from ort_trainer.graph.autograd import SymbolicShapesError, graph_cache_from_env, training_decompositions

from ._graph import OrtGraph, user_input_names
from ._per_shape import PerShapeGraphs
from ._sizes import is_symbolic

__all__ = ["ort_backend"]

_log = logging.getLogger("ort_trainer")


def _compiler(kind: str, said: list[str], names: Sequence[str]) -> Callable:
    def compile_graph(module: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
        graph = _graph(module, example_inputs, kind, said, names)
        if kind != "backward":
            return graph
        # the backward runs outside Dynamo (it must not be traced), still called boxed: `aot_autograd` would wrap
        # it in `torch._dynamo.disable`, which hides `_boxed_call` (and makes AOTAutograd warn about it)
        disabled = torch._dynamo.disable(graph, reason="the ORT backward graph is not traced")

        def backward(args: list) -> list:
            return disabled(args)

        backward._boxed_call = True
        return backward

    compile_graph.__name__ = f"ort_{kind}_compiler"
    if kind == "backward":
        compile_graph._is_wrapped_bw_compiler = True  # wrapped here (above), not again by `aot_autograd`
    return compile_graph


def _graph(
    module: torch.fx.GraphModule, example_inputs: Sequence, kind: str, said: list[str], names: Sequence[str]
) -> Callable:
    """One `OrtGraph`; where its sizes are symbolic and the exporter refuses them, one graph per call's sizes
    (`PerShapeGraphs`), said once per Dynamo graph with the reason. ``names``: the Dynamo graph's inputs."""
    cache = graph_cache_from_env()
    if not any(is_symbolic(e) for e in example_inputs):
        return OrtGraph(module, example_inputs, kind, cache, names)
    original = torch.fx.GraphModule(module, copy.deepcopy(module.graph))  # `OrtGraph` rewrites `module`
    try:
        return OrtGraph(module, example_inputs, kind, cache, names)
    except SymbolicShapesError as error:
        if not said:
            _log.warning(
                "ort_trainer backend: the %s graph with symbolic sizes could not be exported with them (%s); it "
                "runs in ONNX Runtime with one graph per input shape",
                kind, error,
            )  # fmt: skip
            said.append(str(error))
        return PerShapeGraphs(original, kind, cache)


_VIEWS = {
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
    torch.ops.aten.alias.default,
    torch.ops.aten.expand.default,
}


def _partition(joint: torch.fx.GraphModule, joint_inputs: Sequence, **kwargs) -> tuple:
    """``default_partition``, then every saved tensor that is a view (``t``, ``permute``, ``view`` ...) of another
    forward value is saved as that value, and the backward takes the view itself.

    In PyTorch a view costs nothing; in an ONNX graph a saved view is an output of its own, which ONNX Runtime
    writes out: every linear weight transposed and every reshaped activation copied on every forward (GPT-2
    124M: 188 ms of transposes and 69 ms of reshapes in a 1.2 s forward). In the backward the view feeds a
    ``MatMul``, where ORT folds a transpose into the product. What is saved is the same memory as before (the
    base of a view holds the view's elements, an expanded tensor fewer); nothing is recomputed.
    """
    forward, backward = default_partition(joint, joint_inputs, **kwargs)
    _save_view_bases(forward, backward, kwargs["num_fwd_outputs"])
    return forward, backward


def _save_view_bases(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int) -> None:
    output = next(n for n in forward.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    placeholders = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    anchor = [n for n in backward.graph.nodes if n.op == "placeholder"][-1]  # new views go after the inputs
    changed = False
    for position in range(num_fwd_outputs, len(outputs)):
        saved = outputs[position]
        chain = []
        base = saved
        while isinstance(base, torch.fx.Node) and base.op == "call_function" and base.target in _VIEWS:
            chain.append(base)
            base = base.args[0]
        target = placeholders.get(getattr(saved, "name", None))
        if not chain or not isinstance(base, torch.fx.Node) or target is None or "val" not in base.meta:
            continue
        # a view's symbolic sizes are forward nodes: the backward has them as inputs of the same names (saved
        # sizes), or the view stays saved as it is
        sizes = [n for view in chain for n in view.all_input_nodes[1:]]
        if any(n.name not in placeholders for n in sizes):
            continue
        outputs[position] = base
        value, created = target, []
        for view in reversed(chain):  # from the base up to the saved view
            rest = torch.fx.node.map_arg(view.args[1:], lambda n: placeholders[n.name])
            with backward.graph.inserting_after(anchor):
                value = backward.graph.call_function(view.target, (value, *rest), dict(view.kwargs))
            value.meta["val"] = view.meta.get("val")
            created.append(value)
            anchor = value
        for user in list(target.users):
            if user is not created[0]:
                user.replace_input_with(target, value)
        target.meta["val"] = base.meta["val"]
        changed = True
    if changed:
        output.args = (tuple(outputs),)
        forward.graph.eliminate_dead_code()
        forward.recompile()
        backward.graph.lint()
        backward.recompile()


@functools.cache
def _decompositions() -> dict:
    """The autograd engine's `training_decompositions` with ``native_dropout`` kept whole: its keep-mask is then
    lifted as a mask drawn as eager PyTorch draws it (`lift_random_ops` with ``dropout_masks``), where the
    engine's ``rand_like`` would draw other numbers than eager's ``bernoulli_``."""
    table = dict(training_decompositions())
    for op in torch.ops.aten.native_dropout.overloads():
        table.pop(getattr(torch.ops.aten.native_dropout, op), None)
    return table


def ort_backend(gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs) -> Callable:
    """The ``"ort_trainer"`` backend of ``torch.compile``: forward, backward and inference graphs in ORT.

    A graph Dynamo made dynamic (``mark_dynamic``, or a size that changed between calls with ``dynamic=None``, the
    default) is exported once with symbolic dims and serves every size (`_sizes`); one the exporter cannot export
    with them gets one graph per shape, with a warning that says why.
    """
    said: list[str] = []  # the fall-back to graphs per shape, said once for the graphs of this Dynamo graph
    names = user_input_names(gm)  # what a message calls an input (a label out of range)
    backend = aot_autograd(
        fw_compiler=_compiler("forward", said, names),
        bw_compiler=_compiler("backward", said, names),
        inference_compiler=_compiler("inference", said, names),
        partition_fn=_partition,
        decompositions=_decompositions(),
    )
    with sdpa_kernel(SDPBackend.MATH):  # the fused kernels' backward ops have no ONNX translation
        return backend(gm, example_inputs, **kwargs)
