"""`OrtGraph`: one AOTAutograd graph (forward, backward or inference) exported to ONNX and run in ONNX Runtime.

AOTAutograd hands each compiler an aten FX graph and calls the compiled result with a list of tensors
("boxed"). This class exports that graph with the autograd engine's exporter path
(`graph.autograd.graph_to_onnx`, the graphs already traced with `training_decompositions`), keeps the
export in the on-disk graph cache (`graph.autograd.GraphCache`), and runs it in a stock
``onnxruntime.InferenceSession`` over the caller's torch tensors:

* inputs are bound zero-copy through DLPack. On CPU the outputs are allocated by ONNX Runtime from its arena and
  handed back zero-copy (DLPack: the memory returns to the arena when torch frees the tensor), which spares
  fresh pages from the OS every step; on CUDA they are allocated by torch with the shapes and dtypes torch
  computed while tracing (FX ``meta["val"]``) and bound before the run, so ONNX Runtime writes straight into
  the tensors handed back (no host round trip, the session runs on torch's current stream of the build:
  written for CUDA, tested on CPU only);
* what ONNX cannot return is returned around the session: ``None`` gradients (inputs that need none), inputs
  returned as they are (AOTAutograd saves some inputs for the backward), non-tensor constants, and
  duplicates of one value;
* the forward's random draws (Dropout masks) are graph inputs filled from torch's own generator in the
  graph's order (`graph.autograd.lift_random_ops` with ``dropout_masks``): the masks eager PyTorch draws on
  CPU, and torch's RNG state after the step is eager's;
* a graph whose sizes Dynamo made symbolic is exported once with symbolic dims and runs every size
  (`SymbolicSizes`): its int inputs read from the tensors' shapes, the random draws, CUDA outputs and the sizes
  the forward returns for the backward computed at each call from the sizes of that call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import onnxruntime as ort
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx._lazy_graph_module import _LazyGraphModule

from ort_trainer.diagnosis import label_range_message
from ort_trainer.graph.autograd import (
    DISABLED_ORT_OPTIMIZERS,
    GraphCache,
    RandomInput,
    TracedGraph,
    TraceError,
    class_index_inputs,
    lift_random_ops,
    missing_kernel_error,
    output_dtype_error,
)
from ort_trainer.runtime import (
    DeviceSpec,
    from_ortvalue,
    quiet_native_info_logs,
    resolve_device,
    to_ortvalue,
    use_shared_cpu_arena,
)

from ._export import exported, folded_outputs
from ._sizes import SymbolicSizes, is_symbolic

__all__ = ["OrtGraph", "session_options", "user_input_names"]

_log = logging.getLogger("ort_trainer")


@dataclass(frozen=True)
class _LabelInput:
    """A graph input that a cross-entropy / NLL loss inside the module reads as class indices."""

    position: int  # among the graph's inputs
    name: str  # the forward's argument it comes from, for the message
    classes: int
    ignore_index: int


def user_input_names(gm: torch.fx.GraphModule) -> list[str]:
    """The Dynamo graph's inputs as the user knows them: ``label`` for the forward's argument ``label``, else
    Dynamo's source (``L['batch']['labels']``), else the placeholder's name."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        text = getattr(source, "name", None)  # a property or a method, by torch version
        text = text() if callable(text) else text
        text = text if isinstance(text, str) and text else node.name
        names.append(text[3:-2] if text.startswith("L['") and text.endswith("']") and "[" not in text[3:-2] else text)
    return names


def _label_inputs(module: torch.fx.GraphModule, user_names: Sequence[str]) -> list[_LabelInput]:
    """The class-index inputs of an AOTAutograd forward or inference graph (`class_index_inputs`), named after
    the Dynamo graph's input each one is (AOTAutograd's ``PlainAOTInput(idx)`` says which)."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    found = []
    for spec in class_index_inputs(module):
        if spec.classes is None:  # a symbolic class dim: nothing to compare with before the run
            continue
        index = getattr(placeholders[spec.position].meta.get("desc"), "idx", None)
        named = isinstance(index, int) and 0 <= index < len(user_names)
        name = user_names[index] if named else f"{placeholders[spec.position].name} (a loss's target)"
        found.append(_LabelInput(spec.position, name, spec.classes, spec.ignore_index))
    return found


def _check_labels(labels: Sequence[_LabelInput], inputs: Sequence[Any]) -> None:
    """ValueError, as eager PyTorch raises one, for a class index outside [0, classes) that is not the loss's
    ignore_index: ONNX's gather would take a negative one as a class from the end, silently. CPU tensors only:
    on a GPU the check would be a host round trip at every call."""
    for label in labels:
        tensor = inputs[label.position]
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.is_floating_point():
            continue
        message = label_range_message(label.name, tensor, label.classes, label.ignore_index)
        if message is not None:
            raise ValueError(message)


@dataclass(frozen=True)
class _Output:
    """Where one of the FX graph's outputs comes from: "value" (ONNX output ``index``), "input" (graph input
    ``index`` returned as it is), "size" (symbolic size ``index``, evaluated at the call) or "constant"
    (``value``, ``None`` included)."""

    source: str
    index: int = 0
    value: object = None


def session_options() -> ort.SessionOptions:
    """ORT session options for a module's graphs: as many intra-op threads as torch uses (so that
    ``torch.set_num_threads`` decides for both), no spinning pool threads (they take the cores torch's own
    ops need between graphs), ORT's warnings about unused exporter constants off."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    use_shared_cpu_arena(options)  # the forward's and the backward's scratch in one arena (they never overlap)
    return options


def _run_options(device: torch.device) -> ort.RunOptions:
    options = ort.RunOptions()
    # ORT's Python run_with_iobinding looks this key up on every run and, when it is missing, pays for a raised
    # and caught RuntimeError (~60 us); "0" is its default value (no CUDA/WebGPU graph annotation)
    options.add_run_config_entry("gpu_graph_id", "0")
    if device.type == "cuda":  # one stream with torch's kernels (`resolve_device`): no host wait per run
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


class OrtGraph:
    """A compiled AOTAutograd graph: call it with the list of tensors AOTAutograd passes (boxed)."""

    _boxed_call = True  # AOTAutograd passes the argument list itself (and may free it: we do not keep it)

    def __init__(
        self,
        module: torch.fx.GraphModule,
        example_inputs: Sequence,
        kind: str,
        cache: GraphCache | None,
        user_names: Sequence[str] = (),
    ):
        """``user_names``: the names of the Dynamo graph's inputs (the forward's arguments), by their position
        there, for messages (`user_input_names`)."""
        start = time.perf_counter()
        self.kind = kind
        # inputs a loss in the module reads as class indices: checked at each call (read before the graph changes)
        self._labels = _label_inputs(module, user_names) if kind != "backward" else []
        # sizes Dynamo made symbolic: one graph for all of them (`_sizes`); None: every size static
        self.sizes = SymbolicSizes() if any(is_symbolic(e) for e in example_inputs) else None
        size = self.sizes.size if self.sizes is not None else int
        self.random = lift_random_ops(module, dropout_masks=True, size=size) if kind != "backward" else []
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        examples = [
            *example_inputs,
            *(_Spec(r.shape, torch.bool if r.kind == "keep" else r.dtype) for r in self.random),
        ]
        if len(examples) != len(placeholders):
            raise TraceError(f"the {kind} graph has {len(placeholders)} inputs, AOTAutograd gave {len(examples)}")
        self.device = _device_of(examples)
        self.outputs, values, sizes_out = _plan_outputs(module, placeholders, symbolic=self.sizes is not None)
        kept = list(range(len(placeholders)))
        if self.sizes is not None:
            kept = self.sizes.bind(module, placeholders, examples, len(example_inputs))
        self._evaluate(values, sizes_out)
        input_names = {i: f"input_{i}" for i in kept}
        output_names = [f"output_{i}" for i in range(len(values))]
        self._constants: list[torch.Tensor] | None = [] if not values else None  # nothing computed: no graph
        if values:
            # outside Dynamo's fake mode and tracing context: the exporter's trace must not add its own sizes and
            # guards to the ones of the graph Dynamo is compiling
            with unset_fake_temporarily(), torch._guards.tracing(None), _rng_preserved(self.device):
                model = self._export(module, [(input_names[i], examples[i]) for i in kept], output_names, cache)
            # a graph the exporter folded to constants (a backward whose gradients are all zeros): nothing to run
            self._constants = folded_outputs(model, self.device)
            # an output the export computes in another dtype than torch traced (float64 LayerNorm statistics kept
            # in float32): refused here, not handed to the backward graph, which would fail in ONNX Runtime
            mismatch = output_dtype_error(
                model, dict(zip(output_names, self._dtypes, strict=True)), f"the exported {kind} graph"
            )
            if mismatch is not None:
                raise mismatch
        spec = resolve_device(_device_id(self.device))  # on CUDA: ORT runs on torch's current stream
        self.session = _session(model, spec, kind) if self._constants is None else None
        used = {i.name for i in self.session.get_inputs()} if self.session is not None else set()
        self._inputs = [(i, name) for i, name in input_names.items() if name in used]
        self._output_names = output_names
        # On CPU the outputs (the forward's saved activations, the backward's gradients) come from ORT's arena:
        # fresh torch memory is fresh pages from the OS every step (GPT-2 124M step 2790 -> 2487 CPU ms, steady
        # RSS +290 MiB: the arena keeps them). On CUDA torch's caching allocator already reuses its blocks.
        self._ort_outputs = self.device.type == "cpu"
        self._run_options = _run_options(self.device)
        _log.info(
            "ORT %s graph: %d inputs, %d outputs, %d random draws%s, built in %.1f s",
            kind, len(self._inputs), len(values), len(self.random),
            f", symbolic sizes {[str(s) for s in self.sizes.symbols]}" if self.sizes is not None else "",
            time.perf_counter() - start,
        )  # fmt: skip

    def _evaluate(self, values: list, sizes_out: list) -> None:
        """What each call sizes: the random draws (shape, strides), the outputs' shapes and dtypes (allocated by
        torch on CUDA) and the sizes the graph returns; functions of the symbols' values (constants if none)."""
        if self.sizes is None:
            self._draw_sizes = [lambda v, r=r: (r.shape, r.stride) for r in self.random]
            shapes = [tuple(int(d) for d in v.meta["val"].shape) for v in values]
            self._output_shapes = lambda v: shapes
            self._size_outputs = lambda v: ()
        else:
            self._draw_sizes = [self._draw_size(r) for r in self.random]
            ranks = [v.meta["val"].dim() for v in values]
            flat = self.sizes.evaluator([d for v in values for d in v.meta["val"].shape])
            self._output_shapes = lambda v: _split(flat(v), ranks)
            self._size_outputs = self.sizes.evaluator(sizes_out)
        self._dtypes = [v.meta["val"].dtype for v in values]

    def _draw_size(self, spec: RandomInput):
        shape = self.sizes.evaluator(spec.shape)
        stride = self.sizes.evaluator(spec.stride) if spec.stride is not None else None
        return lambda v: (shape(v), stride(v) if stride is not None else None)

    def _export(self, module: torch.fx.GraphModule, inputs: list, output_names: list, cache) -> onnx.ModelProto:
        """The graph exported (or taken from the cache), over real tensors shaped as the examples (the traced
        sample's sizes), the symbolic dims as the exporter's ``dynamic_shapes``."""
        names = [name for name, _ in inputs]
        # AOTAutograd's graphs recompile lazily: until then `forward` takes (*args, **kwargs), against which the
        # exporter cannot match a `dynamic_shapes` entry per input
        _LazyGraphModule.force_recompile(module)
        if self.sizes is None:
            sample = tuple(_real(e, self.device) for _, e in inputs)
            return exported(TracedGraph(module, names, output_names, sample), cache, self.kind)
        shapes = self.sizes.dynamic_shapes([e for _, e in inputs])
        sample = tuple(torch.zeros(self.sizes.hint_shape(e), dtype=e.dtype, device=self.device) for _, e in inputs)
        traced = TracedGraph(module, names, output_names, sample, export_shapes=shapes)
        model = exported(traced, cache, self.kind)
        self.sizes.check(model, names, shapes)
        return model

    def __call__(self, *given: Any) -> list:
        """Boxed (one list, which is emptied: AOTAutograd's convention) or, where torch's ``disable`` wrapper
        hides ``_boxed_call`` (the backward), the tensors as arguments."""
        if len(given) == 1 and isinstance(given[0], list):
            inputs = list(given[0])
            given[0].clear()
        else:
            inputs = list(given)
        _check_labels(self._labels, inputs)
        values = self.sizes.values(inputs) if self.sizes is not None else ()
        inputs += [_draw(r, *size(values), self.device) for r, size in zip(self.random, self._draw_sizes, strict=True)]
        if self._constants is not None:
            results = [value.clone() for value in self._constants]
            return [self._rebuild(out, results, inputs, self._size_outputs(values)) for out in self.outputs]
        io = self.session.io_binding()
        kept = []
        for index, name in self._inputs:
            tensor = inputs[index].contiguous()
            kept.append(tensor)
            io.bind_ortvalue_input(name, to_ortvalue(tensor))
        if self._ort_outputs:
            for name in self._output_names:
                io.bind_output(name, "cpu", 0)
        else:
            shapes = self._output_shapes(values)
            results = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(shapes, self._dtypes, strict=True)]
            for name, tensor in zip(self._output_names, results, strict=True):
                io.bind_ortvalue_output(name, to_ortvalue(tensor))
        self.session.run_with_iobinding(io, self._run_options)
        del kept
        if self._ort_outputs:
            results = [
                _as_dtype(from_ortvalue(value), dtype)
                for value, dtype in zip(io._iobinding.get_outputs(), self._dtypes, strict=True)
            ]
        sizes = self._size_outputs(values)
        return [self._rebuild(out, results, inputs, sizes) for out in self.outputs]

    @staticmethod
    def _rebuild(out: _Output, results: list, inputs: list, sizes: Sequence[int]) -> object:
        if out.source == "value":
            return results[out.index]
        if out.source == "input":
            return inputs[out.index]
        if out.source == "size":
            return sizes[out.index]
        return out.value


@dataclass(frozen=True)
class _Spec:
    """Shape and dtype of a lifted random input (AOTAutograd knows nothing of it)."""

    shape: tuple[int | str, ...]  # a str: a symbolic size (`SymbolicSizes.size`)
    dtype: torch.dtype


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ONNX Runtime's DLPack export gives a bool tensor as uint8: viewed back as the dtype torch traced."""
    return tensor.view(dtype) if tensor.dtype != dtype and tensor.element_size() == dtype.itemsize else tensor


def _plan_outputs(module: torch.fx.GraphModule, placeholders: list, *, symbolic: bool) -> tuple[list, list, list]:
    """Rewrite the graph to return each distinct computed tensor once; how to rebuild AOTAutograd's outputs, the
    tensors the graph returns, and the symbolic sizes it returned (``symbolic``: evaluated at each call instead)."""
    output_node = next(n for n in module.graph.nodes if n.op == "output")
    given = output_node.args[0]
    given = list(given) if isinstance(given, tuple | list) else [given]
    positions = {node: i for i, node in enumerate(placeholders)}
    plan, values, seen, sizes = [], [], {}, []
    for value in given:
        if isinstance(value, torch.fx.Node) and value in positions:
            plan.append(_Output("input", positions[value]))
        elif isinstance(value, torch.fx.Node):
            example = value.meta.get("val")
            if symbolic and isinstance(example, torch.SymInt | int):  # a size the forward saves for the backward
                plan.append(_Output("size", len(sizes)))
                sizes.append(example)
                continue
            if not isinstance(example, torch.Tensor):
                raise TraceError(
                    f"the graph returns {value.name} = {example!r}, not a tensor: ORTModule's graphs return tensors "
                    "and sizes"
                )
            if value not in seen:
                seen[value] = len(values)
                values.append(value)
            plan.append(_Output("value", seen[value]))
        else:
            plan.append(_Output("constant", value=value))
    output_node.args = (tuple(values),)
    module.graph.eliminate_dead_code()
    module.recompile()
    return plan, values, sizes


def _split(flat: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """``flat`` cut into shapes of these ranks."""
    shapes, start = [], 0
    for rank in ranks:
        shapes.append(tuple(flat[start : start + rank]))
        start += rank
    return shapes


def _session(model: onnx.ModelProto, spec: DeviceSpec, kind: str) -> ort.InferenceSession:
    with quiet_native_info_logs():
        try:
            return ort.InferenceSession(
                model.SerializeToString(),
                session_options(),
                spec.providers,
                disabled_optimizers=list(DISABLED_ORT_OPTIMIZERS),
            )
        except Exception as error:  # noqa: BLE001 - ONNX Runtime's load errors are one class (Fail/InvalidGraph)
            provider = spec.providers[0] if isinstance(spec.providers[0], str) else spec.providers[0][0]
            missing = missing_kernel_error(error, model, provider, f"the exported {kind} graph")
            if missing is not None:  # a float64 or bfloat16 graph on a provider without kernels of that type
                raise missing from error
            raise TraceError(
                f"ONNX Runtime {ort.__version__} cannot load the exported {kind} graph: "
                f"{str(error).strip().splitlines()[0]}. This is a fault of the exporter's translation of an op "
                "(the node's name says which); run this module in eager PyTorch or report the op"
            ) from error


def _draw(spec: RandomInput, shape: tuple, stride: tuple | None, device: torch.device) -> torch.Tensor:
    """One random input of this call's ``shape`` (and, for a keep-mask, ``stride``), drawn from torch's default
    generator of ``device`` as eager PyTorch would."""
    if spec.kind == "keep":  # eager CPU Dropout: empty_like(x).bernoulli_(1 - p), in x's memory layout
        mask = torch.empty_strided(shape, stride or _contiguous(shape), dtype=spec.dtype, device=device)
        return mask.bernoulli_(spec.probability).bool()
    if spec.kind == "normal":
        return torch.randn(shape, dtype=spec.dtype, device=device)
    return torch.rand(shape, dtype=spec.dtype, device=device)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _real(example, device: torch.device) -> torch.Tensor:
    """A real tensor shaped like a (fake) example input, for the exporter (it reads shapes and dtypes)."""
    if isinstance(example, _Spec | torch.Tensor):
        return torch.zeros(tuple(int(d) for d in example.shape), dtype=example.dtype, device=device)
    raise TraceError(
        f"ORTModule compiles graphs of tensors with static shapes; an input is {type(example).__name__} "
        f"({example!r}): pass tensors (a Python number that changes between calls should be a tensor)"
    )


def _device_of(examples: Sequence) -> torch.device:
    devices = {e.device for e in examples if isinstance(e, torch.Tensor)}
    devices.discard(torch.device("meta"))
    if len(devices) > 1:
        raise TraceError(f"the graph's inputs are on several devices {sorted(map(str, devices))}: move them to one")
    return next(iter(devices), torch.device("cpu"))


def _device_id(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[None]:
    """The export must not advance torch's generators: the first step's Dropout masks are drawn after it."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
