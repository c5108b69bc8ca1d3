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
  CPU, and torch's RNG state after the step is eager's.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ort_trainer.diagnosis import quiet_native_info_logs
from ort_trainer.engine import DeviceSpec, from_ortvalue, resolve_device, to_ortvalue, use_shared_cpu_arena
from ort_trainer.graph.autograd import (
    DISABLED_ORT_OPTIMIZERS,
    GraphCache,
    TracedGraph,
    TraceError,
    graph_to_onnx,
    lift_random_ops,
)

__all__ = ["OrtGraph", "session_options"]

_log = logging.getLogger("ort_trainer")


@dataclass(frozen=True)
class _Output:
    """Where one of the FX graph's outputs comes from: "value" (ONNX output ``index``), "input" (graph input
    ``index`` returned as it is), or "constant" (``value``, ``None`` included)."""

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


class OrtGraph:
    """A compiled AOTAutograd graph: call it with the list of tensors AOTAutograd passes (boxed)."""

    _boxed_call = True  # AOTAutograd passes the argument list itself (and may free it: we do not keep it)

    def __init__(self, module: torch.fx.GraphModule, example_inputs: Sequence, kind: str, cache: GraphCache | None):
        start = time.perf_counter()
        self.kind = kind
        self.random = lift_random_ops(module, dropout_masks=True) if kind != "backward" else []
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        examples = [
            *example_inputs,
            *(_Spec(r.shape, torch.bool if r.kind == "keep" else r.dtype) for r in self.random),
        ]
        if len(examples) != len(placeholders):
            raise TraceError(f"the {kind} graph has {len(placeholders)} inputs, AOTAutograd gave {len(examples)}")
        self.device = _device_of(examples)
        self.outputs, values = _plan_outputs(module, placeholders)
        self._shapes = [(tuple(int(d) for d in v.meta["val"].shape), v.meta["val"].dtype) for v in values]
        input_names = [f"input_{i}" for i in range(len(placeholders))]
        output_names = [f"output_{i}" for i in range(len(values))]
        self._constants: list[torch.Tensor] | None = [] if not values else None  # nothing computed: no graph
        if values:
            with unset_fake_temporarily(), _rng_preserved(self.device):
                sample = tuple(_real(e, self.device) for e in examples)
                traced = TracedGraph(module, input_names, output_names, sample)
                model = _exported(traced, cache, kind)
            # a graph the exporter folded to constants (a backward whose gradients are all zeros): nothing to run
            self._constants = _folded_outputs(model, self.device)
        spec = resolve_device(_device_id(self.device))  # on CUDA: ORT runs on torch's current stream
        self.session = _session(model, spec, kind) if self._constants is None else None
        used = {i.name for i in self.session.get_inputs()} if self.session is not None else set()
        self._inputs = [(i, name) for i, name in enumerate(input_names) if name in used]
        self._output_names = output_names
        # On CPU the outputs (the forward's saved activations, the backward's gradients) come from ORT's arena:
        # fresh torch memory is fresh pages from the OS every step (GPT-2 124M step 2790 -> 2487 CPU ms, steady
        # RSS +290 MiB: the arena keeps them). On CUDA torch's caching allocator already reuses its blocks.
        self._ort_outputs = self.device.type == "cpu"
        self._run_options = ort.RunOptions()
        # ORT's Python run_with_iobinding looks this key up on every run and, when it is missing, pays for a raised
        # and caught RuntimeError (~60 us); "0" is its default value (no CUDA/WebGPU graph annotation)
        self._run_options.add_run_config_entry("gpu_graph_id", "0")
        if self.device.type == "cuda":  # one stream with torch's kernels (`resolve_device`): no host wait per run
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        _log.info(
            "ORT %s graph: %d inputs, %d outputs, %d random draws, built in %.1f s",
            kind, len(self._inputs), len(values), len(self.random), time.perf_counter() - start,
        )  # fmt: skip

    def __call__(self, *given: Any) -> list:
        """Boxed (one list, which is emptied: AOTAutograd's convention) or, where torch's ``disable`` wrapper
        hides ``_boxed_call`` (the backward), the tensors as arguments."""
        draws = [_draw(r, self.device) for r in self.random]
        if len(given) == 1 and isinstance(given[0], list):
            inputs = [*given[0], *draws]
            given[0].clear()
        else:
            inputs = [*given, *draws]
        if self._constants is not None:
            results = [value.clone() for value in self._constants]
            return [self._rebuild(out, results, inputs) for out in self.outputs]
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
            results = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._shapes]
            for name, tensor in zip(self._output_names, results, strict=True):
                io.bind_ortvalue_output(name, to_ortvalue(tensor))
        self.session.run_with_iobinding(io, self._run_options)
        del kept
        if self._ort_outputs:
            results = [
                _as_dtype(from_ortvalue(value), dtype)
                for value, (_, dtype) in zip(io._iobinding.get_outputs(), self._shapes, strict=True)
            ]
        return [self._rebuild(out, results, inputs) for out in self.outputs]

    @staticmethod
    def _rebuild(out: _Output, results: list, inputs: list) -> object:
        if out.source == "value":
            return results[out.index]
        if out.source == "input":
            return inputs[out.index]
        return out.value


@dataclass(frozen=True)
class _Spec:
    """Shape and dtype of a lifted random input (AOTAutograd knows nothing of it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ONNX Runtime's DLPack export gives a bool tensor as uint8: viewed back as the dtype torch traced."""
    return tensor.view(dtype) if tensor.dtype != dtype and tensor.element_size() == dtype.itemsize else tensor


def _plan_outputs(module: torch.fx.GraphModule, placeholders: list) -> tuple[list[_Output], list]:
    """Rewrite the graph to return each distinct computed tensor once; how to rebuild AOTAutograd's outputs."""
    output_node = next(n for n in module.graph.nodes if n.op == "output")
    given = output_node.args[0]
    given = list(given) if isinstance(given, tuple | list) else [given]
    positions = {node: i for i, node in enumerate(placeholders)}
    plan, values, seen = [], [], {}
    for value in given:
        if isinstance(value, torch.fx.Node) and value in positions:
            plan.append(_Output("input", positions[value]))
        elif isinstance(value, torch.fx.Node):
            example = value.meta.get("val")
            if not isinstance(example, torch.Tensor):
                raise TraceError(
                    f"the graph returns {value.name} = {example!r}, not a tensor (a symbolic size?): ORTModule "
                    "compiles static shapes only; call it with tensors of fixed shapes"
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
    return plan, values


def _to_onnx(traced: TracedGraph, kind: str) -> onnx.ModelProto:
    """`graph_to_onnx`, its error told in ORTModule's terms: the op, the user's line that calls it, the ways out."""
    try:
        return graph_to_onnx(traced)
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


def _exported(traced: TracedGraph, cache: GraphCache | None, kind: str) -> onnx.ModelProto:
    if cache is None:
        return _to_onnx(traced, kind)
    key = cache.key(traced.fingerprint(), {"ortmodule": kind})
    try:
        building = cache.building(key)
        building.__enter__()
    except OSError as error:  # a read-only or full cache folder must not stop training
        _log.warning("graph cache %s unusable (%s): exporting without it", cache.directory, error)
        return _to_onnx(traced, kind)
    try:
        model = cache.get(key)
        if model is not None:
            _log.info("graph cache: ORTModule %s graph loaded from %s", kind, cache.directory)
            return model
        model = _to_onnx(traced, kind)
        try:
            cache.put(key, model)
        except OSError as error:
            _log.warning("graph cache %s: could not store the graph (%s)", cache.directory, error)
        return model
    finally:
        building.__exit__(None, None, None)


def _folded_outputs(model: onnx.ModelProto, device: torch.device) -> list[torch.Tensor] | None:
    """The outputs of a graph without nodes (every output an initializer), else None."""
    if model.graph.node:
        return None
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    missing = [o.name for o in model.graph.output if o.name not in values]
    if missing:
        raise TraceError(f"the exported graph has no nodes and no values for its outputs {missing}")
    return [torch.from_numpy(values[o.name].copy()).to(device) for o in model.graph.output]


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
            raise TraceError(
                f"ONNX Runtime {ort.__version__} cannot load the exported {kind} graph: "
                f"{str(error).strip().splitlines()[0]}. This is a fault of the exporter's translation of an op "
                "(the node's name says which); run this module in eager PyTorch or report the op"
            ) from error


def _draw(spec, device: torch.device) -> torch.Tensor:
    """One random input, drawn from torch's default generator of ``device`` as eager PyTorch would."""
    if spec.kind == "keep":  # eager CPU Dropout: empty_like(x).bernoulli_(1 - p), in x's memory layout
        mask = torch.empty_strided(spec.shape, spec.stride or _contiguous(spec.shape), dtype=spec.dtype, device=device)
        return mask.bernoulli_(spec.probability).bool()
    if spec.kind == "normal":
        return torch.randn(spec.shape, dtype=spec.dtype, device=device)
    return torch.rand(spec.shape, dtype=spec.dtype, device=device)


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
