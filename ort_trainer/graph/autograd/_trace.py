"""`trace_graph`: the aten graph of one training (forward + backward) or eval (forward) run of a module.

The model's state enters as explicit inputs through ``torch.func.functional_call``, so the traced graph
takes (trainable parameters, frozen float state, other buffers, the ``model_desc`` inputs) and nothing
of the user's module is read or changed while tracing, beyond switching its train/eval mode (restored
afterwards). Tracing is ``make_fx`` in fake mode: no real computation runs, no memory for activations
is allocated, and torch's random generator is not advanced.

Training graphs return ``(model_desc outputs..., <param>_grad..., <buffer>_updated...)``: the backward
is ``torch.autograd.grad`` of the loss, traced below the dispatcher as AOTAutograd does, so its formulas
are PyTorch's own (``padding_idx``, ``ignore_index``, ``no_grad`` regions, ``detach`` and custom
``autograd.Function`` backward included). A trainable parameter the loss does not reach gets no output
(``TracedGraph.idle``): like a torch parameter whose ``grad`` stays ``None``, it is never updated.
Buffers that the forward writes in place (BatchNorm's running statistics and ``num_batches_tracked``, a counter
of the model's own) come back as ``<name>_updated`` outputs, computed by PyTorch's own update (unbiased running
variance included).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.graph._forward import ModelWithLoss, OutputContractError, OutputContractTypeError
from ort_trainer.graph._module_checks import refuse_max_norm
from ort_trainer.graph._names import outer_module, plain_module

from ._decompositions import training_decompositions
from ._precision import Precision
from ._random import RandomInput, lift_random_ops
from ._symbolic import DynamicAxes, Specialised, SymbolicTrace, random_shape, signature_shape

__all__ = [
    "GRAD_SUFFIX",
    "UPDATED_SUFFIX",
    "GraphNames",
    "SymbolicShapesError",
    "TraceError",
    "TracedGraph",
    "trace_graph",
]

GRAD_SUFFIX = "_grad"  # output "<param>_grad": the parameter's gradient
UPDATED_SUFFIX = "_updated"  # output "<buffer>_updated": a buffer's value after the forward
_PREFIX = "model."  # ModelWithLoss holds the module as `model`
_LIBRARY_DIRS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[2]))


@dataclass
class GraphNames:
    """The names that bind a finished graph to the trainer: its inputs and outputs, which parameters get a
    gradient, which buffers it writes, and its random inputs. Stored as JSON in a cached graph, so that a
    cache hit binds the graph without a trace (`to_json` / `from_json`)."""

    input_names: list[str]  # trainable, frozen, constants, model_desc inputs, random draws
    output_names: list[str]  # model_desc outputs, then <param>_grad, then <buffer>_updated
    trained: list[str] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unused_inputs: tuple[str, ...] = ()
    state_count: int = 0
    random_inputs: list[RandomInput] = field(default_factory=list)
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)  # input -> {axis: dim class}: symbolic dims
    guards: list[tuple[str, str]] = field(default_factory=list)  # (condition on the dim classes, where): `_symbolic`

    def to_json(self) -> str:
        randoms = [
            [r.name, list(r.shape), str(r.dtype).removeprefix("torch."), r.kind, r.probability, r.stride]
            for r in self.random_inputs
        ]
        fields = {
            "inputs": self.input_names,
            "outputs": self.output_names,
            "trained": self.trained,
            "idle": self.idle,
            "updated": self.updated,
            "unused": list(self.unused_inputs),
            "state_count": self.state_count,
            "random": randoms,
            "dynamic": self.dynamic,
            "guards": [list(g) for g in self.guards],
        }
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> GraphNames:
        """Parse `to_json`'s text; ValueError when it is not that (a cache file from another version)."""
        try:
            data = json.loads(text)
            randoms = [
                RandomInput(name, tuple(shape), getattr(torch, dtype), kind, float(p), None if s is None else tuple(s))
                for name, shape, dtype, kind, p, s in data["random"]
            ]
            names = cls(
                input_names=[str(n) for n in data["inputs"]],
                output_names=[str(n) for n in data["outputs"]],
                trained=[str(n) for n in data["trained"]],
                idle=[str(n) for n in data["idle"]],
                updated=[str(n) for n in data["updated"]],
                unused_inputs=tuple(str(n) for n in data["unused"]),
                state_count=int(data["state_count"]),
                random_inputs=randoms,
                dynamic={str(n): {int(a): str(d) for a, d in axes.items()} for n, axes in data["dynamic"].items()},
                guards=[(str(text), str(where)) for text, where in data["guards"]],
            )
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"not the names of a cached graph ({type(error).__name__}: {error})") from None
        if not all(isinstance(r.dtype, torch.dtype) for r in randoms):
            raise ValueError("not the names of a cached graph (a random input's dtype is not a torch dtype)")
        return names


@dataclass
class TracedGraph:
    """A traced aten graph and what ties its inputs and outputs to the trainer's names."""

    module: torch.fx.GraphModule
    input_names: list[str]  # trainable, frozen, constants (buffers that are not float), model_desc inputs
    output_names: list[str]  # model_desc outputs, then <param>_grad, then <buffer>_updated
    sample_args: tuple[torch.Tensor, ...]  # real tensors, in input order (the exporter's example inputs)
    trained: list[str] = field(default_factory=list)  # parameters with a gradient output
    idle: list[str] = field(default_factory=list)  # trainable parameters the loss does not reach
    updated: list[str] = field(default_factory=list)  # buffers written by the forward (frozen state, then others)
    unused_inputs: tuple[str, ...] = ()  # model_desc inputs the graph never reads
    state_count: int = 0  # the first `state_count` inputs are state, then the model_desc inputs
    random_inputs: list[RandomInput] = field(default_factory=list)  # last inputs: the step's random draws
    symbolic: SymbolicTrace | None = None  # the named input dims traced as symbols (None: every size static)
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)  # input -> {axis: class}: dims left symbolic
    specialised: list[Specialised] = field(default_factory=list)  # named dims the model's code made static
    guards: list[tuple[str, str]] = field(default_factory=list)  # what the graph assumes of its symbolic dims
    # the exporter's ``dynamic_shapes`` as the caller gives them (ORTModule's graphs, whose sizes Dynamo made
    # symbolic: `module._sizes`); None: from `symbolic` (the engine's named dims) or every size static
    export_shapes: tuple | None = None
    _pending: tuple | None = None  # what `finish` still has to do: (description, frozen names, training)

    def finish(self) -> None:
        """Functionalise (a second trace of the first, in-place writes and views made out-of-place with the same
        decompositions: the exporter's own scatter translations of view writes are what ONNX Runtime could not
        load), keep the frozen-state outputs that were written, and lift the random draws into inputs.

        Only needed before an export: a cache hit takes all of it from the cached graph (`apply_metadata`)."""
        if self._pending is None:
            return
        what, frozen, training = self._pending
        symbolic = SymbolicTrace(self.symbolic.axes) if self.symbolic is not None else None
        with _explained(what):
            functional = torch.func.functionalize(self.module, remove="mutations")
            args = symbolic.fake(self.input_names, self.sample_args) if symbolic is not None else self.sample_args
            mode = "symbolic" if symbolic is not None else "fake"
            table = training_decompositions()
            module = make_fx(functional, decomposition_table=table, tracing_mode=mode)(*args)
        self.updated = _keep_written(module, frozen)  # eval mode too: a forward that counts its calls
        self.output_names += [n + UPDATED_SUFFIX for n in self.updated]
        if training:
            try:
                self.random_inputs = lift_random_ops(module, size=symbolic.expression if symbolic else int)
            except ValueError as error:
                if symbolic is None:
                    raise
                raise SymbolicShapesError(str(error)) from error
        if symbolic is not None:
            # what the user's code assumed of a size is recorded by the first trace (the second one replays its graph)
            first = self.symbolic.guards() if self.symbolic is not None else []
            self.symbolic = symbolic
            self.dynamic, self.specialised = symbolic.classes()
            self.guards = first + [g for g in symbolic.guards() if g not in first]
        device = self.sample_args[0].device if self.sample_args else torch.device("cpu")
        sizes = self.sample_sizes()
        draws = tuple(
            torch.rand(random_shape(r.shape, sizes), dtype=r.dtype, device=device) for r in self.random_inputs
        )
        self.module, self._pending = module, None
        self.input_names = self.input_names + [r.name for r in self.random_inputs]
        self.sample_args = self.sample_args + draws

    def names(self) -> GraphNames:
        """What binds the finished graph to the trainer (after `finish` or `apply_metadata`)."""
        return GraphNames(
            input_names=list(self.input_names),
            output_names=list(self.output_names),
            trained=list(self.trained),
            idle=list(self.idle),
            updated=list(self.updated),
            unused_inputs=tuple(self.unused_inputs),
            state_count=self.state_count,
            random_inputs=list(self.random_inputs),
            dynamic={n: dict(a) for n, a in self.dynamic.items()},
            guards=list(self.guards),
        )

    def sample_sizes(self) -> dict[str, int]:
        """Each symbolic dim class's size in the traced sample (what the sample's random draws are sized by)."""
        given = dict(zip(self.input_names, self.sample_args, strict=False))
        return {label: int(given[n].shape[a]) for n, axes in self.dynamic.items() for a, label in axes.items()}

    def dynamic_shapes(self) -> tuple | None:
        """The exporter's ``dynamic_shapes`` for the finished graph: a ``torch.export.Dim`` per symbolic class on
        every input dim of that class (random draws included); None when every dim is static. ValueError when a
        random draw's dim is an expression of several classes (the exporter takes single dims)."""
        if self.export_shapes is not None:
            return self.export_shapes
        if not self.dynamic or self.symbolic is None:
            return None
        dims = self.symbolic.export_dims()
        randoms = {r.name: r for r in self.random_inputs}
        spec = []
        for name in self.input_names:
            if name in self.dynamic:
                spec.append({axis: dims[label] for axis, label in self.dynamic[name].items()})
            elif name in randoms:
                axes = {axis: dims.get(dim) for axis, dim in enumerate(randoms[name].shape) if isinstance(dim, str)}
                unknown = [randoms[name].shape[axis] for axis, dim in axes.items() if dim is None]
                if unknown:
                    raise ValueError(f"the random draw {name} has dims {unknown} that are not single input dims")
                spec.append(axes or None)
            else:
                spec.append(None)
        return tuple(spec)

    def metadata(self) -> str:
        """What a cached graph needs beside the ONNX model to be bound: JSON (`apply_metadata`)."""
        return self.names().to_json()

    def apply_metadata(self, text: str) -> None:
        """Take the finished graph's names from a cached graph's `metadata` (instead of `finish`)."""
        names = GraphNames.from_json(text)
        self.output_names, self.updated, self.input_names = names.output_names, names.updated, names.input_names
        self.random_inputs = names.random_inputs
        self.dynamic, self.guards = names.dynamic, names.guards
        self._pending = None

    def fingerprint(self) -> str:
        """sha256 of what decides the exported graph: the code, input names/shapes/dtypes, output names,
        and the values of tensor constants baked into the graph."""
        digest = hashlib.sha256(self.module.code.encode())
        digest.update(repr((self.input_names, self.output_names)).encode())
        axes = self.symbolic.axes if self.symbolic is not None else {}
        if self.export_shapes is not None:  # a symbolic axis is keyed as symbolic, not by the sample's size
            given = zip(self.input_names, self.export_shapes, strict=True)
            axes = {n: dict.fromkeys(d or {}, "dynamic") for n, d in given}
        digest.update(repr(sorted((n, sorted(a.items())) for n, a in axes.items())).encode())
        for name, arg in zip(self.input_names, self.sample_args, strict=False):
            digest.update(repr((signature_shape(arg.shape, axes.get(name)), str(arg.dtype))).encode())
        for name, buffer in sorted(self.module.named_buffers()):
            digest.update(name.encode())
            digest.update(buffer.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                value = getattr(self.module, str(node.target), None)
                if isinstance(value, torch.Tensor):
                    digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


class TraceError(ValueError):
    """The module could not be traced into one graph (data-dependent control flow, an untraceable op...)."""


class SymbolicShapesError(TraceError):
    """The graph traced with symbolic dims could not be exported with them (the exporter found a constraint on
    the dims the trace did not, or a random draw's dim is an expression of several): trace it per shape."""


def _distinct(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` with each repeated object replaced by a copy.

    Tracing turns each real tensor into a fake one once, by identity: one tensor given as two inputs (a language
    model's ``labels=input_ids``) became one fake tensor whose uses were all recorded against the last placeholder,
    so the graph never read the first input, and later steps with their own labels trained on the wrong tensor."""
    seen: set[int] = set()
    distinct = []
    for tensor in tensors:
        distinct.append(tensor.clone() if id(tensor) in seen else tensor)
        seen.add(id(tensor))
    return tuple(distinct)


def trace_graph(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    desc: ModelDescription,
    trainable: Mapping[str, torch.Tensor],
    frozen: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    training: bool,
    precision: Precision | None = None,
    dynamic: DynamicAxes | None = None,
) -> TracedGraph:
    """Trace ``model`` (+ ``loss_fn``) with its state given as tensors, named by canonical names.

    ``trainable`` / ``frozen``: canonical name -> tensor (the trainer's views; only shapes and dtypes are
    read). The module's other buffers (integer ones such as position ids and ``num_batches_tracked``, non-persistent
    float ones) are graph inputs too, named as the module names them; the trainer feeds their current values.
    ``training``: the joint forward + backward graph in train mode, else the forward in eval mode.
    ``precision``: float32, or traced under ``torch.autocast`` (mixed precision), with a loss-scale input
    after the ``model_desc`` inputs when it scales the loss (`Precision`; None: float32).
    ``dynamic``: ``{input: {axis: dim name}}``, the input dims traced as symbols (`_symbolic`); None or empty:
    a graph for these inputs' sizes only.
    """
    precision = precision or Precision()
    axes = {n: dict(a) for n, a in (dynamic or {}).items() if n in desc.input_names and a}
    symbolic = SymbolicTrace(axes) if axes else None
    if symbolic is not None:
        given = symbolic.sample(axes, dict(zip(desc.input_names, inputs, strict=True)))
        inputs = [given[n] for n in desc.input_names]
    with plain_module(outer_module(model)) as plain, _modes_restored(plain), _dense_embedding_gradients(plain):
        refuse_max_norm(plain)
        wrapper = ModelWithLoss(plain, loss_fn, desc).train(training)
        known = set(trainable) | set(frozen)
        # every other buffer (ints, and float buffers outside the state dict: non-persistent ones such as rotary
        # inv_freq) enters as an input too, so that tracing never touches a real tensor of the module
        constants = {n: b for n, b in plain.named_buffers() if n not in known}
        names = [*trainable, *frozen, *constants]
        extra = precision.extra_inputs(training)
        _check_input_names(names, desc, extra)
        extra_values = [torch.ones((), dtype=torch.float32, device=_device_of(inputs, trainable)) for _ in extra]
        sample = _distinct((*trainable.values(), *frozen.values(), *constants.values(), *inputs, *extra_values))
        function, result = _graph_function(
            wrapper, desc, (list(trainable), list(frozen), list(constants)), training, precision
        )
        what = f"the {'training' if training else 'eval'} graph of {type(plain).__name__}"
        with _explained(what), torch.enable_grad(), _math_attention():
            args = symbolic.fake([*names, *desc.input_names, *extra], sample) if symbolic is not None else sample
            mode = "symbolic" if symbolic is not None else "fake"
            table = training_decompositions()
            module = make_fx(function, decomposition_table=table, tracing_mode=mode)(*args)
    _refuse_parameter_writes(module, list(trainable))
    outputs = list(desc.output_names)
    if training:
        outputs += [n + GRAD_SUFFIX for n in result["trained"]]
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    given = [*names, *desc.input_names, *extra]
    unused = tuple(
        name
        for name, node in zip(given, placeholders[: len(given)], strict=True)
        if name in desc.input_names and not node.users
    )
    return TracedGraph(
        module=module,
        input_names=given,
        output_names=outputs,
        sample_args=tuple(t.detach() for t in sample),
        trained=result["trained"],
        idle=[n for n in trainable if n not in result["trained"]],
        unused_inputs=unused,
        state_count=len(names),
        symbolic=symbolic,
        _pending=(what, [*frozen, *constants], training),  # every buffer the forward may write
    )


def _check_input_names(names: list[str], desc: ModelDescription, extra: Sequence[str]) -> None:
    """ValueError for a ``model_desc`` input, or the loss-scale input mixed precision adds, named as model state."""
    clash = sorted(set(names) & set(desc.input_names))
    if clash:
        raise ValueError(f"model_desc inputs {clash} have the names of model state; rename the inputs")
    taken = sorted(set(extra) & (set(names) | set(desc.input_names)))
    if taken:
        raise ValueError(
            f"mixed precision adds the graph input {taken[0]!r} (the loss scale), but the model already has an "
            "input or state of that name; rename it"
        )


def _graph_function(wrapper, desc: ModelDescription, state_names, training: bool, precision: Precision):
    """The function make_fx traces, and a dict it fills while tracing (which outputs the graph has)."""
    trainable, frozen, constants = state_names
    counts = (len(trainable), len(frozen), len(constants), len(desc.input_names))
    result: dict[str, list[str]] = {"trained": [], "updated": []}

    def run(*args):
        params, rest = args[: counts[0]], args[counts[0] :]
        frozen_values, rest = rest[: counts[1]], rest[counts[1] :]
        constant_values, rest = rest[: counts[2]], rest[counts[2] :]
        inputs, extra = rest[: counts[3]], rest[counts[3] :]
        leaves = [p.detach().requires_grad_(training) for p in params]
        # buffers written in place by the forward (BatchNorm's statistics and counter): clones, returned as outputs
        frozen_copies = [t.clone() for t in frozen_values]
        constant_copies = [t.clone() for t in constant_values]
        state = {_PREFIX + n: t for n, t in zip(trainable, leaves, strict=True)}
        state.update({_PREFIX + n: t for n, t in zip(frozen, frozen_copies, strict=True)})
        state.update({_PREFIX + n: t for n, t in zip(constants, constant_copies, strict=True)})
        with contextlib.nullcontext() if training else torch.no_grad(), precision.forward(params):
            outputs = functional_call(wrapper, state, tuple(inputs), strict=False)
        outputs = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
        if len(outputs) != len(desc.output_names):
            raise OutputContractError(
                f"the model (with loss_fn: the loss followed by the model's predictions) returned {len(outputs)} "
                f"outputs, but model_desc declares {len(desc.output_names)}: {list(desc.output_names)}"
            )
        if not training:  # the buffers it wrote too (not BatchNorm's in eval mode; a counter of the model's own)
            return (*precision.outputs(outputs), *frozen_copies, *constant_copies)
        loss = outputs[desc.loss_index]
        if not loss.requires_grad:
            raise ValueError(
                f"the loss does not depend on any trainable parameter {list(trainable)}; check that the loss "
                "depends on them (and that they are not all frozen)"
            )
        if extra:  # GradScaler.scale: the backward starts from loss * scale (float32, whatever the loss's dtype)
            loss = loss.to(torch.float32) * extra[0]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        result["trained"] = [n for n, g in zip(trainable, grads, strict=True) if g is not None]
        detached = [o.detach() for o in precision.outputs(outputs)]
        # the unchanged buffers are dropped by `_keep_written`
        return (*detached, *[g for g in grads if g is not None], *frozen_copies, *constant_copies)

    return run, result


def _keep_written(module: torch.fx.GraphModule, frozen: list[str]) -> list[str]:
    """Drop the buffer outputs (``frozen``: the frozen state, then the other buffers) the forward did not write;
    the names of those it did, in order.

    Each such tensor enters the graph as a ``clone`` of its placeholder, and make_fx returns the last
    node that produced it: the clone itself when nothing wrote to it, an in-place op (BatchNorm's ``copy_``)
    when something did. (Version counters cannot tell: make_fx records in-place ops without bumping them.)
    """
    output = next(n for n in module.graph.nodes if n.op == "output")
    values = list(output.args[0])
    first = len(values) - len(frozen)
    kept, written = values[:first], []
    for name, node in zip(frozen, values[first:], strict=True):
        untouched = node.op == "call_function" and node.target == torch.ops.aten.clone.default
        if not (untouched and node.args[0].op == "placeholder"):
            kept.append(node)
            written.append(name)
    output.args = (tuple(kept),)
    module.graph.eliminate_dead_code()
    module.recompile()
    return written


def _device_of(inputs: Sequence[torch.Tensor], state: Mapping[str, torch.Tensor]) -> torch.device:
    return next((t.device for t in (*state.values(), *inputs)), torch.device("cpu"))


@contextlib.contextmanager
def _math_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` as its math (matmul, softmax) above autograd.

    The fused CPU/CUDA kernels (flash, memory-efficient) reach the trace as single ops whose backward ops
    have no ONNX translation; the math backend decomposes before autograd sees it, so the backward is
    made of ordinary ops, as with eager attention.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


@contextlib.contextmanager
def _modes_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put every submodule's train/eval mode back as it was (tracing switches them)."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _refuse_parameter_writes(module: torch.fx.GraphModule, trainable: list[str]) -> None:
    """A forward that writes a trainable parameter in place (``F.embedding(max_norm=...)``'s renorm, a
    ``clamp_`` under ``no_grad``): the graph returns gradients, not parameters, so the write would be lost and
    the run would silently leave torch's. Refused, naming the parameter and the op."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"][: len(trainable)]
    names = dict(zip(placeholders, trainable, strict=True))
    for node in module.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args, strict=False):
            if argument.alias_info is None or not argument.alias_info.is_write or not isinstance(value, torch.fx.Node):
                continue
            root = _alias_root(value)
            if root in names:
                raise ValueError(
                    f"the forward writes the parameter {names[root]!r} in place ({schema.name}, e.g. "
                    "F.embedding(..., max_norm=...) or an in-place op under torch.no_grad()): a training graph "
                    "returns gradients, so the write would be lost; write the parameter between steps instead, "
                    "outside the forward"
                )


def _alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``node`` is a view or alias of (``detach``, ``view``, ``t``, ...), followed to its source."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or first.alias_info.is_write:
            break
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


@contextlib.contextmanager
def _dense_embedding_gradients(module: torch.nn.Module) -> Iterator[None]:
    """Trace ``Embedding`` / ``EmbeddingBag(sparse=True)`` with the dense backward, then put ``sparse`` back.

    The sparse gradient's shape depends on the ids (one row per lookup), which one graph cannot hold; summed
    into the weight it is the dense gradient, and our optimizers update a dense flat buffer anyway (as the
    onnxblock engine does). The forward is the same either way."""
    flipped = [m for m in module.modules() if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse]
    for m in flipped:
        m.sparse = False
    try:
        yield
    finally:
        for m in flipped:
            m.sparse = True


@contextlib.contextmanager
def _meta_failures_unlogged() -> Iterator[None]:
    """Fake mode logs an op that fails on fake tensors (a float label in cross_entropy's gather) with its whole
    traceback at ERROR, then raises it: the error reaches the user as our `TraceError`, or as the TypeError that
    names the input, so the log line only repeats it as 15 lines of torch internals. A filter (not a level):
    it drops that one message, and concurrent traces (each adds its own) cannot leave the logger changed."""

    def not_a_meta_failure(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addFilter(not_a_meta_failure)
    try:
        yield
    finally:
        logger.removeFilter(not_a_meta_failure)


@contextlib.contextmanager
def _explained(what: str) -> Iterator[None]:
    """Tracing failures as a `TraceError` naming the user's line and the way out; our own errors pass."""
    try:
        with _meta_failures_unlogged():
            yield
    except (OutputContractError, OutputContractTypeError, TraceError):
        raise
    except ValueError as error:
        if "does not depend on any trainable parameter" in str(error) or "model_desc" in str(error):
            raise
        raise _trace_error(what, error) from error
    except Exception as error:  # noqa: BLE001 - every tracing failure gets the same explanation
        raise _trace_error(what, error) from error


def _trace_error(what: str, error: Exception) -> TraceError:
    where = _user_frame(error)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    hint = (
        "Python control flow that depends on tensor values (if/while on a tensor, .item(), .tolist(), "
        "data-dependent shapes) cannot be traced into one graph: compute it with tensor ops (torch.where, "
        "masking), or train this model with options={'utils': {'engine': 'onnxblock'}} where "
        "onnxruntime-training is installed"
    )
    return TraceError(
        f"the autograd engine could not trace {what}{f' at {where}' if where else ''}: "
        f"{type(error).__name__}: {first}. {hint}"
    )


def _user_frame(error: BaseException) -> str:
    """``file:line (code)`` of the innermost frame outside torch and ort_trainer, if any."""
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith(_LIBRARY_DIRS) or frame.filename.startswith("<"):
            continue
        found = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return found
