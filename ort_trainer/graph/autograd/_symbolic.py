"""Symbolic dims: one traced graph for every size of the input dims ``model_desc`` names with a string.

The trace (`_trace.trace_graph`) runs in fake mode over fake tensors whose named input dims are symbols (each its
own, ``DimDynamic.DYNAMIC``: two dims are one only where the model's ops prove it) and whose state is static.
What the trace then knows about each symbol decides the graph:

* a dim the model's ops equate with another (``input_ids`` and ``labels`` share batch and sequence) joins its
  class: one ``torch.export.Dim`` for the class, named after its first ``model_desc`` name;
* a dim the model specialises to a constant (a size its code compares, a reshape to a literal) is static in the
  graph: the session then keys graphs by that dim's size, and the user is told once, with the line
  (`Specialised`);
* the graph's random draws (Dropout masks) take shapes written with the classes' names (``("batch", "seq", 64)``),
  so the session can size them for each batch (`random_shape`).

A dim of size 1 in the sample batch is traced at size 2 (the input repeated along it: a size-1 dim is
specialised to 1 by every tracer, since broadcasting differs there); the ONNX graph itself runs size 1.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import sympy
import torch
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._sympy.numbers import int_oo

__all__ = ["DynamicAxes", "Specialised", "SymbolicTrace", "broken_guard", "random_shape", "signature_shape"]

DynamicAxes = Mapping[str, Mapping[int, str]]  # input name -> {axis: dim name}, as `ModelDescription.dynamic_axes`


@dataclass
class Specialised:
    """A named dim the model's code made static: its size in the traced batch, and where (file:line)."""

    name: str
    size: int
    where: str


@dataclass
class SymbolicTrace:
    """The fake inputs of one symbolic trace and, after it, what the trace made of each named dim."""

    axes: dict[str, dict[int, str]]  # input -> {axis: dim name}: the dims asked to be symbolic
    mode: FakeTensorMode = field(init=False)
    _symbols: dict[tuple[str, int], sympy.Symbol] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)

    @staticmethod
    def sample(axes: DynamicAxes, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inputs`` with each named dim of size 1 repeated to size 2 (module docstring); others unchanged."""
        out = dict(inputs)
        for name, dims in axes.items():
            tensor = out.get(name)
            if tensor is None:
                continue
            for axis in dims:
                if axis < tensor.dim() and tensor.shape[axis] == 1:
                    tensor = torch.cat([tensor, tensor], dim=axis)
            out[name] = tensor
        return out

    def fake(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Fake tensors for the trace: the named input dims symbolic, everything else static."""
        fakes = []
        first: dict[str, torch.SymInt] = {}  # each dim name's first symbol: the same name is the same dim
        for name, value in zip(names, values, strict=True):
            dims = self.axes.get(name, {})
            dynamic = [DimDynamic.DYNAMIC if axis in dims else DimDynamic.STATIC for axis in range(value.dim())]
            context = StatelessSymbolicContext(dynamic_sizes=dynamic)
            fake = self.mode.from_tensor(value, source=LocalSource(name), symbolic_context=context)
            for axis, label in dims.items():
                if axis < value.dim():
                    size = fake.shape[axis]
                    if label in first and value.shape[axis] == first[label].node.hint:
                        torch._check(size == first[label])  # one symbol from here on (a replacement, no guard)
                    first.setdefault(label, size)
                    self._symbols[(name, axis)] = size.node.expr
            fakes.append(fake)
        return fakes

    # ------------------------------------------------------------ after the trace
    def classes(self) -> tuple[dict[str, dict[int, str]], list[Specialised]]:
        """The dims that stayed symbolic, each named by its class (``{input: {axis: class name}}``), and the named
        dims the trace specialised to a constant."""
        env = self.mode.shape_env
        names: dict[sympy.Expr, str] = {}
        kept: dict[str, dict[int, str]] = {}
        specialised: list[Specialised] = []
        for (input_name, axis), symbol in self._symbols.items():
            canonical = env.replace(symbol)
            label = self.axes[input_name][axis]
            if canonical.is_number:
                if label not in {s.name for s in specialised}:
                    specialised.append(Specialised(label, int(canonical), _where(env, symbol)))
                continue
            kept.setdefault(input_name, {})[axis] = names.setdefault(canonical, label)
        return kept, specialised

    def guards(self) -> list[tuple[str, str]]:
        """What the model's code assumed of the symbolic dims beyond their being sizes (``seq > 4`` for an ``if``
        on a size, ``Mod(seq, 2) == 0``): ``(condition over the class names, where)`` each. A batch whose sizes
        break one is not run on this graph (`holds`): the session builds one for its shape instead."""
        env = self.mode.shape_env
        names = self._names_by_symbol()
        found = []
        for guard in env.guards:
            expr = env.simplify(env.replace(guard.expr))
            if expr in (sympy.true, True) or not expr.free_symbols:
                continue
            if expr.free_symbols - set(names):  # a size that is no input dim: nothing a batch could break
                continue
            text = str(expr.xreplace({s: sympy.Symbol(n, integer=True, positive=True) for s, n in names.items()}))
            where = getattr(guard.sloc, "maybe_user_loc", None) or str(guard.sloc)
            found.append((text, str(where)))
        return found

    def _names_by_symbol(self) -> dict[sympy.Symbol, str]:
        env = self.mode.shape_env
        by_symbol: dict[sympy.Symbol, str] = {}
        for (input_name, axis), symbol in self._symbols.items():
            canonical = env.replace(symbol)
            if isinstance(canonical, sympy.Symbol):
                by_symbol.setdefault(canonical, _python_name(self.axes[input_name][axis]))
        return by_symbol

    def expression(self, size: int | torch.SymInt) -> int | str:
        """A traced size as an int or an expression of the class names ("batch", "seq * 4")."""
        if not isinstance(size, torch.SymInt):
            return int(size)
        env = self.mode.shape_env
        expr = env.replace(size.node.expr)
        if expr.is_number:
            return int(expr)
        by_symbol = self._names_by_symbol()
        unknown = expr.free_symbols - set(by_symbol)
        if unknown:
            raise ValueError(
                f"a traced size {expr} depends on sizes that are not input dims ({sorted(map(str, unknown))})"
            )
        return str(expr.xreplace({s: sympy.Symbol(n, integer=True, positive=True) for s, n in by_symbol.items()}))

    def export_dims(self) -> dict[str, torch.export.Dim]:
        """One ``torch.export.Dim`` per class, bounded as the trace bounds it, by class name and by the name its
        random-draw expressions use (`expression`)."""
        dims = {}
        for label, (low, high) in self.ranges().items():
            name = _python_name(label)
            dim = torch.export.Dim(name, min=low) if high is None else torch.export.Dim(name, min=low, max=high)
            dims[label] = dims[name] = dim
        return dims

    def ranges(self) -> dict[str, tuple[int, int | None]]:
        """Each class's (min, max) as the trace bounds it (max None: unbounded), for its ``torch.export.Dim``."""
        env = self.mode.shape_env
        out: dict[str, tuple[int, int | None]] = {}
        kept, _ = self.classes()
        for (input_name, axis), symbol in self._symbols.items():
            label = kept.get(input_name, {}).get(axis)
            canonical = env.replace(symbol)
            if label is None or label in out or not isinstance(canonical, sympy.Symbol):
                continue
            bounds = env.var_to_range.get(canonical)
            low = _finite(bounds.lower) if bounds is not None else None
            high = _finite(bounds.upper) if bounds is not None else None
            out[label] = (max(low if low is not None else 2, 1), high)
        return out


def _finite(bound: sympy.Expr) -> int | None:
    """A range bound as an int; None for torch's infinities (``int_oo``, which sympy's ``is_finite`` calls finite)."""
    if bound in (int_oo, -int_oo) or not bound.is_number:
        return None
    return int(bound)


def _python_name(label: str) -> str:
    """A dim name as a sympy symbol name (``input_ids.1`` -> ``input_ids_1``); `random_shape` maps it back."""
    return "".join(c if c.isalnum() else "_" for c in label)


def _where(env: ShapeEnv, symbol: sympy.Symbol) -> str:
    sloc = env.replacements_slocs.get(symbol)
    if sloc is None:
        return "an unknown line"
    user = getattr(sloc, "maybe_user_loc", None)
    return str(user or getattr(sloc, "framework_loc", None) or sloc)


def signature_shape(shape: Sequence[int], axes: Mapping[int, str] | None) -> tuple:
    """An input's shape as a session keys its graphs: each symbolic axis by its class name, others by size."""
    if not axes:
        return tuple(shape)
    return tuple(axes.get(axis, size) for axis, size in enumerate(shape))


def random_shape(shape: Sequence[int | str], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """A random input's shape for one batch: ``sizes`` maps each class name to its size in the batch."""
    if all(isinstance(d, int) for d in shape):
        return tuple(shape)
    named = {_python_name(n): int(v) for n, v in sizes.items()}
    out = []
    for dim in shape:
        if isinstance(dim, int):
            out.append(dim)
        elif dim in named:
            out.append(named[dim])
        else:
            expr = _parsed(dim)
            value = expr.xreplace({s: sympy.Integer(named[s.name]) for s in expr.free_symbols if s.name in named})
            if not value.is_number:
                raise ValueError(f"a random input's dim {dim!r} names dims this batch does not give ({sorted(sizes)})")
            out.append(int(value))
    return tuple(out)


def broken_guard(guards: Sequence[tuple[str, str]], sizes: Mapping[str, int]) -> tuple[str, str] | None:
    """The first of a graph's `SymbolicTrace.guards` that a batch of these ``sizes`` (class name -> size) breaks,
    or None when the graph holds for it."""
    values = {n: int(v) for n, v in sizes.items()}
    named = {_python_name(n): v for n, v in values.items()}
    for text, where in guards:
        expr = _parsed(text)
        value = expr.xreplace({s: sympy.Integer(named[s.name]) for s in expr.free_symbols if s.name in named})
        if value.free_symbols or not bool(value):
            return text, where
    return None


@functools.lru_cache(maxsize=256)
def _parsed(expression: str) -> sympy.Expr:
    return sympy.sympify(expression)
