"""`SymbolicSizes`: an AOTAutograd graph whose sizes Dynamo made symbolic, exported once for every size.

Dynamo makes a dim symbolic when it is marked (``torch._dynamo.mark_dynamic``) or, by default, once its size has
changed between calls. AOTAutograd then hands each compiler a graph whose tensors have symbolic shapes (``s0``,
``2*s0``, ``s0*s1``), whose inputs include the sizes themselves (int placeholders: the forward's symbolic sizes, the
sizes the forward saves for the backward), and calls it with plain ints. torch's own backends compile such a graph
once, with the sizes as arguments; here it is exported to one ONNX graph with symbolic dims:

* each int input is replaced in the graph by the size of a tensor input that has it (``aten.sym_size``), or an
  expression of such sizes: the ONNX graph takes tensors only and derives every size from their shapes, so it
  cannot be fed a size that contradicts them;
* the exporter (``torch.export`` underneath) takes each symbolic axis of a tensor input as ``Dim.DYNAMIC``: it
  finds the relations between them itself (a saved ``(s0*s1, 16)`` activation against ``s0`` and ``s1``) and
  refuses to make one a constant; a graph it refuses is exported per shape instead (`module._backend`);
* at each call the symbols' values are read from the inputs (an int input, or a tensor dim that is the bare
  symbol), and what the caller sizes from them is evaluated: the random draws (Dropout keep-masks, their strides),
  the outputs torch allocates (CUDA) and the sizes the forward returns for the backward. ONNX Runtime allocates the
  rest, saved activations included.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import sympy
import torch
from torch.export import Dim
from torch.fx.node import map_arg
from torch.utils._sympy.functions import FloorDiv
from torch.utils._sympy.printers import PythonPrinter

from ort_trainer.graph.autograd import SymbolicShapesError

__all__ = ["SymbolicSizes", "is_symbolic"]

_Source = tuple[int, int | None]  # (input index, tensor axis), axis None: the input is the size itself


def is_symbolic(value: object) -> bool:
    """Whether ``value`` is a symbolic size, or a tensor with one in its shape."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


class SymbolicSizes:
    """The symbols of one graph, where each call reads their values, and what is evaluated from them."""

    def __init__(self) -> None:
        self._texts: dict[str, sympy.Expr] = {}  # `size`'s texts (random draws' shapes) -> their expressions
        self.symbols: list[sympy.Symbol] = []
        self._sources: list[_Source] = []
        self._hints: dict[sympy.Symbol, int] = {}

    def size(self, value: int | torch.SymInt) -> int | str:
        """A traced size as `lift_random_ops` writes it down: an int, or the text of its expression."""
        expr = _expression(value)
        if expr.is_number:
            return int(expr)
        self._texts[str(expr)] = expr
        return str(expr)

    def bind(self, module: torch.fx.GraphModule, placeholders: list, examples: Sequence, given: int) -> list[int]:
        """Find where each call gives each symbol, and replace the graph's int inputs by sizes of its tensor inputs
        (in place); the positions of the inputs the graph keeps (the tensors). ``given``: how many of ``examples``
        the caller gives (the rest are random draws, sized from the others). `SymbolicShapesError` where a symbol
        is no given input's size, or an int input cannot be computed from tensor dims."""
        shapes = [self.shape(e) if _is_tensor(e) else None for e in examples]
        used: set[sympy.Symbol] = set()
        for index, example in enumerate(examples):
            exprs = shapes[index] if shapes[index] is not None else [self.expression(example)]
            used.update(s for e in exprs if isinstance(e, sympy.Expr) for s in e.free_symbols)
            for axis, expr in enumerate(exprs):
                if isinstance(expr, sympy.Symbol) and index < given:
                    self._hints.setdefault(expr, _hint(example, axis if shapes[index] is not None else None))
                    if expr not in self.symbols:
                        self.symbols.append(expr)
                        self._sources.append((index, axis if shapes[index] is not None else None))
        missing = sorted(map(str, used - set(self.symbols)))
        if missing:
            raise SymbolicShapesError(f"the sizes {missing} are no input's size")
        return _replace_int_inputs(module, placeholders, examples[:given], shapes)

    def shape(self, example: Any) -> list[int | sympy.Expr]:
        """A tensor input's shape: an int or an expression per axis."""
        return [self.expression(d) for d in example.shape]

    def expression(self, value: int | str | torch.SymInt) -> int | sympy.Expr:
        """A size as an int or a sympy expression of the graph's symbols."""
        expr = self._texts[value] if isinstance(value, str) else _expression(value)
        return int(expr) if expr.is_number else expr

    def evaluator(self, sizes: Sequence[int | str | torch.SymInt]) -> Callable[[Sequence[int]], tuple[int, ...]]:
        """``sizes`` evaluated from the symbols' values at a call (`values`), as one compiled function."""
        exprs = [self.expression(s) for s in sizes]
        if not any(isinstance(e, sympy.Expr) for e in exprs):
            constant = tuple(int(e) for e in exprs)
            return lambda values: constant
        function = sympy.lambdify(self.symbols, exprs, modules=[], printer=PythonPrinter())
        try:  # a size written with a function Python has no name for fails here, at build, not in a step
            function(*(self._hints[s] for s in self.symbols))
        except Exception as error:  # noqa: BLE001 - whatever the printed expression raises
            raise SymbolicShapesError(f"cannot evaluate the sizes {exprs} ({type(error).__name__}: {error})") from None
        return lambda values: tuple(function(*values))

    def values(self, inputs: Sequence) -> tuple[int, ...]:
        """The symbols' values at a call, read from its inputs."""
        return tuple(int(inputs[i]) if axis is None else inputs[i].shape[axis] for i, axis in self._sources)

    def hint_shape(self, example: Any) -> tuple[int, ...]:
        """A tensor input's shape in the traced sample (the sizes Dynamo saw when it made them symbolic)."""
        return self.evaluator(list(example.shape))(tuple(self._hints[s] for s in self.symbols))

    def dynamic_shapes(self, examples: Sequence) -> tuple:
        """The exporter's ``dynamic_shapes`` for these tensor inputs: ``Dim.DYNAMIC`` on every symbolic axis."""
        spec = []
        for example in examples:
            axes = {axis: Dim.DYNAMIC for axis, e in enumerate(self.shape(example)) if isinstance(e, sympy.Expr)}
            spec.append(axes or None)
        return tuple(spec)

    @staticmethod
    def check(model: onnx.ModelProto, names: Sequence[str], spec: Sequence) -> None:
        """`SymbolicShapesError` where the exported graph took a symbolic axis as a constant."""
        inputs = {i.name: i for i in model.graph.input}
        for name, axes in zip(names, spec, strict=True):
            value = inputs.get(name)
            if value is None or not axes:
                continue
            dims = value.type.tensor_type.shape.dim
            fixed = [axis for axis in axes if axis < len(dims) and not dims[axis].dim_param]
            if fixed:
                raise SymbolicShapesError(f"the exporter made the symbolic dims {fixed} of {name} constants")


def _is_tensor(example: Any) -> bool:
    return isinstance(example, torch.Tensor) or hasattr(example, "shape")  # a random draw's spec has a shape


def _expression(value: int | torch.SymInt) -> sympy.Expr:
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(int(value))


def _hint(example: Any, axis: int | None) -> int:
    size = example if axis is None else example.shape[axis]
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _replace_int_inputs(module: torch.fx.GraphModule, placeholders: list, given: Sequence, shapes: list) -> list:
    """Each int input replaced by a tensor input's dim of the same expression, or built from the dims of its
    symbols (``s0*s1`` from the two); the positions of the inputs kept. ``given``: the examples of the inputs
    the caller gives (not the random draws)."""
    graph = module.graph
    dims: dict[sympy.Expr, tuple[torch.fx.Node, int]] = {}
    for node, exprs in zip(placeholders[: len(given)], shapes, strict=False):
        if exprs is not None:
            for axis, expr in enumerate(exprs):
                dims.setdefault(expr, (node, axis))
    kept = [index for index, exprs in enumerate(shapes) if exprs is not None]
    if len(kept) == len(placeholders):
        return kept
    # the sizes' nodes go after the inputs, before any other node (`inserting_before` keeps their order)
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for node, example, exprs in zip(placeholders, given, shapes, strict=False):
        if exprs is not None:
            continue
        if node.users:
            with graph.inserting_before(anchor):
                value = _build(graph, _expression(example), dims)
            for user in list(node.users):
                user.args = map_arg(user.args, lambda n, v=value, old=node: v if n is old else n)
                user.kwargs = map_arg(user.kwargs, lambda n, v=value, old=node: v if n is old else n)
        graph.erase_node(node)
    graph.lint()
    module.recompile()
    return kept


def _build(graph: torch.fx.Graph, expr: sympy.Expr, dims: dict) -> int | torch.fx.Node:
    """``expr`` as FX nodes over the tensor inputs' dims (``sym_size``, ``+``, ``*``, ``//``)."""
    if expr.is_number:
        return int(expr)
    if expr in dims:
        node, axis = dims[expr]
        return graph.call_function(torch.ops.aten.sym_size.int, (node, axis))
    if isinstance(expr, sympy.Add | sympy.Mul):
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
        args = [_build(graph, a, dims) for a in expr.args]
        value = args[0]
        for arg in args[1:]:
            value = graph.call_function(op, (value, arg))
        return value
    if isinstance(expr, FloorDiv):
        return graph.call_function(operator.floordiv, tuple(_build(graph, a, dims) for a in expr.args))
    raise SymbolicShapesError(f"the size {expr} is no tensor input's dim, nor a sum, product or quotient of them")
