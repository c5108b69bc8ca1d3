"""`graph_to_onnx`: a traced aten graph as an ONNX model of standard ops, through the dynamo exporter.

The exporter (``torch.onnx.export(..., dynamo=True)``, onnxscript's aten library) re-exports the traced
graph with ``torch.export`` and translates each aten op; its own graph optimizer folds constants and
removes dead code. Inputs and outputs get the names the trainer binds (state names, ``model_desc``
names, ``<param>_grad``); `_onnx_passes` then collapses transpose/reshape chains, scatters a tied
embedding's gradient into its head's instead of into zeros, and writes the loss's gradient without its one-hot.
The exporter's progress prints and warnings are kept out of the user's log.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import re
import warnings

import onnx
import torch

from ._onnx_passes import (
    collapse_layout_chains,
    drop_unread_initializers,
    fold_one_hot_loss_gradients,
    fold_zero_scatter_adds,
)
from ._trace import SymbolicShapesError, TracedGraph, TraceError

__all__ = ["graph_to_onnx"]

_NOISY_LOGGERS = (
    "onnx_ir",
    "torch.onnx",
    "torch.export",
    "torch._export",
    "onnxscript",
    "torch.fx.experimental.symbolic_shapes",
)


def graph_to_onnx(traced: TracedGraph) -> onnx.ModelProto:
    """Export ``traced`` with named inputs/outputs; `TraceError` naming the op the exporter cannot translate."""
    with _quiet():
        try:
            program = _export(traced)
        except Exception as error:  # noqa: BLE001 - the exporter's errors are long; name the op and the way out
            if traced.export_shapes is not None or (traced.symbolic is not None and traced.dynamic):
                raise SymbolicShapesError(f"{type(error).__name__}: {_first_line(error)}") from error
            ops = sorted(set(re.findall(r"OpOverload\(op='([^']+)'", _all_messages(error))))
            what = (
                f"no ONNX translation for {', '.join(ops)}" if ops else f"{type(error).__name__}: {_first_line(error)}"
            )
            raise TraceError(
                f"the dynamo ONNX exporter could not translate the traced graph ({what}). "
                "An aten op without an ONNX translation can be given one with onnxscript "
                "(torch.onnx.export's custom_translation_table), or train this model with "
                "options={'utils': {'engine': 'onnxblock'}} where onnxruntime-training is installed"
            ) from error
        _optimize(program)  # its passes log too (onnx_ir: a folded constant that is a graph output)
    model = program.model_proto
    _check_names(model, traced)
    _name_symbolic_dims(model, traced)
    collapse_layout_chains(model)
    fold_zero_scatter_adds(model)
    fold_one_hot_loss_gradients(model)
    drop_unread_initializers(model)
    return model


def _name_symbolic_dims(model: onnx.ModelProto, traced: TracedGraph) -> None:
    """The exporter names a symbolic dim after torch's symbol (``s51``); name it after its class, as ``model_desc``
    does (``batch``), wherever it appears: inputs, outputs and the inferred shapes between them."""
    inputs = {i.name: i for i in model.graph.input}
    names: dict[str, str] = {}
    for name, axes in traced.dynamic.items():
        value = inputs.get(name)
        if value is None:
            continue
        dims = value.type.tensor_type.shape.dim
        for axis, label in axes.items():
            if axis < len(dims) and dims[axis].dim_param:
                names.setdefault(dims[axis].dim_param, label)
    if not names:
        return
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def _export(traced: TracedGraph):
    """``torch.onnx.export(dynamo=True)`` with the translation registry built once per process.

    The public call rebuilds onnxscript's registry of aten translations on every export (1.1-2.3 s on our
    2-core CI machine, a quarter of a small model's build); the exporter's own entry point takes it as an
    argument. Where that entry point is not there (another torch), the public call runs.
    """
    core, registry = _exporter_core()
    dynamic_shapes = traced.dynamic_shapes()
    if core is None:
        return torch.onnx.export(
            traced.module,
            traced.sample_args,
            input_names=traced.input_names,
            output_names=traced.output_names,
            dynamic_shapes=dynamic_shapes,
            dynamo=True,
            optimize=False,
            verbose=False,
            report=False,
        )
    return core.export(
        traced.module,
        traced.sample_args,
        registry=registry,
        dynamic_shapes=dynamic_shapes,
        input_names=traced.input_names,
        output_names=traced.output_names,
        optimize=False,
        verbose=False,
        report=False,
    )


def _optimize(program) -> None:
    """The exporter's graph optimizer without its pattern rewriter: constants folded (up to its size limits),
    dead and duplicate nodes removed, constants lifted to initializers.

    The rewriter's rules cost 19 s of a 50 s GPT-2 124M export and change only transpose and reshape chains
    in our graphs, which `collapse_layout_chains` collapses in one walk. Where onnxscript's passes are not
    where we expect them (another onnxscript), the exporter's whole optimizer runs.
    """
    passes = _optimizer_passes()
    if passes is None:
        program.optimize()
        return
    passes(program.model)


@functools.cache
def _optimizer_passes():
    try:
        import onnx_ir as ir
        import onnx_ir.passes.common as common
        from onnxscript.optimizer import _constant_folding as folding
    except ImportError:
        return None
    try:
        loop = ir.passes.PassManager(
            [
                folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                ),
                common.RemoveUnusedNodesPass(),
                common.RemoveUnusedFunctionsPass(),
                common.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        )
        return ir.passes.Sequential(
            common.InlinePass(),
            loop,
            common.RemoveUnusedNodesPass(),
            common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
            common.LiftSubgraphInitializersToMainGraphPass(),
            common.DeduplicateInitializersPass(),
            common.CommonSubexpressionEliminationPass(),
            common.OutputFixPass(),
            common.NameFixPass(),
        )
    except (AttributeError, TypeError):
        return None


@functools.cache
def _exporter_core():
    """(the exporter's ``_core`` module, its torchlib registry), or (None, None) where torch has neither."""
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration

        registry = _registration.ONNXRegistry().from_torchlib(opset_version=_constants.TORCHLIB_OPSET)
    except (ImportError, AttributeError, TypeError):
        return None, None
    if "registry" not in inspect.signature(_core.export).parameters:
        return None, None
    return _core, registry


def _all_messages(error: BaseException) -> str:
    """The messages of ``error`` and of the errors it was raised from."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_names(model: onnx.ModelProto, traced: TracedGraph) -> None:
    """The exporter keeps our output names; an input it dropped (unused) is simply not fed."""
    got = [o.name for o in model.graph.output]
    if got != traced.output_names:
        raise TraceError(f"the exported graph has outputs {got}, expected {traced.output_names}")


@contextlib.contextmanager
def _quiet():
    """No exporter progress on stdout, no warnings about training mode, exporter loggers at ERROR."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
