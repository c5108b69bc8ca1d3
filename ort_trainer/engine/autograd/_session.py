"""`AutogradSession`: the autograd engine's graphs, run in a stock ``onnxruntime.InferenceSession``.

The training graph (`graph.autograd`) takes the state and the inputs and returns the ``model_desc``
outputs, one ``<param>_grad`` per trained parameter and the ``<buffer>_updated`` values of buffers the
forward writes. As in the onnxblock engine, the state is bound zero-copy once (DLPack views of the flat
buffers), and a step binds only the user's inputs:

* a step that starts an accumulation window binds every ``<param>_grad`` output to that parameter's view
  of the flat gradient buffer, so ONNX Runtime writes the gradients where the optimizer reads them;
* a later micro-step binds them to a scratch flat buffer of the same layout (made on first use, zeroed
  where no gradient lands) and adds it to the gradient buffer in one vectorised ``add_``;
* ``<buffer>_updated`` values (BatchNorm running statistics and counter, PyTorch's own update) are copied into
  the frozen state or the other buffers after the run.

A new shape of a dynamic ``model_desc`` dim is traced and exported again (from the on-disk graph cache
when it was seen before) and gets its own session; the ``max_shapes`` most recent ones are kept.
The eval graph is built on the first eval step (or ``save_as_onnx``).
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from ort_trainer.graph.autograd import (
    DISABLED_ORT_OPTIMIZERS,
    GraphNames,
    RandomInput,
    TraceError,
    broken_guard,
    random_shape,
    signature_shape,
)
from ort_trainer.runtime import (
    DeviceSpec,
    OutputBinding,
    quiet_native_info_logs,
    release_freed_memory,
    run_options,
    to_ortvalue,
    track,
)

from .._progress import BuildProgress

__all__ = ["AutogradGraphs", "AutogradSession"]

_log = logging.getLogger("ort_trainer")


@dataclass
class AutogradGraphs:
    """One input signature's exported graph, the names the trainer binds to it, and the user inputs it was
    built for."""

    model: onnx.ModelProto
    names: GraphNames
    inputs: dict[str, torch.Tensor]


class _ShapeSession:
    """One training (or eval) graph in one InferenceSession, its state bound once."""

    def __init__(self, owner: AutogradSession, graphs: AutogradGraphs, *, training: bool):
        self.graphs = graphs
        options, device = owner._session_options, owner._device
        with quiet_native_info_logs():
            try:
                self.session = track(
                    ort.InferenceSession(
                        graphs.model.SerializeToString(),
                        options,
                        device.providers,
                        disabled_optimizers=list(DISABLED_ORT_OPTIMIZERS),
                    )
                )
            except Exception as error:  # noqa: BLE001 - ONNX Runtime's load errors are one class (Fail/InvalidGraph)
                raise TraceError(
                    f"ONNX Runtime {ort.__version__} cannot load the exported {'training' if training else 'eval'} "
                    f"graph: {str(error).strip().splitlines()[0]}. This is a fault of the exporter's translation of "
                    "an op (the node's name says which); train this model with options={'utils': {'engine': "
                    "'onnxblock'}} where onnxruntime-training is installed (docs/engines.md)"
                ) from error
        self.io = self.session.io_binding()
        wanted = {i.name for i in self.session.get_inputs()}
        self.input_names = wanted
        self.bind_state(owner._state)
        names = graphs.names
        self.grad_names = [(n, n + "_grad") for n in names.trained] if training else []
        self.updated = [(n, n + "_updated") for n in names.updated]  # eval graphs too: what the forward wrote
        read = set(owner._user_outputs) | {out for _, out in self.updated}
        grad_outputs = {out for _, out in self.grad_names}
        self.out = OutputBinding(self.session, self.io, device, read - grad_outputs)
        # the step's random draws (Dropout masks): graph inputs filled before every training run (`fill_random`),
        # sized by the batch where the graph has symbolic dims (made, and bound, when the batch's sizes change)
        self._device = device.torch_device
        self.random: list[tuple[RandomInput, torch.Tensor | None]] = [
            (spec, None) for spec in names.random_inputs if spec.name in wanted
        ]
        self._bound_target: str | None = None  # "grads" or "scratch": where the gradient outputs point now

    def bind_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Bind the state (once; again when its storage moved) and let the gradient outputs be bound anew."""
        for name, tensor in state.items():
            if name in self.input_names:
                self.io.bind_ortvalue_input(name, to_ortvalue(tensor))
        self._bound_target = None

    def fill_random(self, generator: torch.Generator, sizes: Mapping[str, int]) -> None:
        """Draw this run's random inputs; ``sizes``: the batch's size of each symbolic dim class."""
        for index, (spec, buffer) in enumerate(self.random):
            shape = random_shape(spec.shape, sizes)
            if buffer is None or tuple(buffer.shape) != shape:
                buffer = torch.empty(shape, dtype=spec.dtype, device=self._device)
                self.random[index] = (spec, buffer)
                self.io.bind_ortvalue_input(spec.name, to_ortvalue(buffer))
            if spec.kind == "normal":
                buffer.normal_(generator=generator)
            else:
                buffer.uniform_(generator=generator)

    def bind_gradients(self, targets: Mapping[str, torch.Tensor], which: str) -> None:
        if self._bound_target == which:
            return
        for name, output in self.grad_names:
            self.io.bind_ortvalue_output(output, to_ortvalue(targets[name]))
        self._bound_target = which


class AutogradSession:
    """The autograd engine's sessions over the trainer's buffers (a `StepSession`, as `TrainingSession` is)."""

    # The generator is seeded before every training run (`engine._step`; a microsecond), whether or not the graph
    # of the moment draws: a graph built inside a step (a new shape) that draws Dropout masks then draws this step's.
    draws_randomness = True

    def __init__(
        self,
        build: Callable[[Mapping[str, torch.Tensor] | None, bool], AutogradGraphs],
        first: AutogradGraphs,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        flat_grads: torch.Tensor,
        frozen: Mapping[str, torch.Tensor],
        constants: Mapping[str, torch.Tensor],
        user_outputs: list[str],
        device: DeviceSpec,
        session_options: ort.SessionOptions,
        shrink_arena: bool = False,
        max_shapes: int = 4,
        explain: Callable[[Mapping[str, torch.Tensor], Exception], Exception | None] | None = None,
        step_inputs: Sequence[str] = (),
    ):
        self._build, self._device, self._explain = build, device, explain
        self._session_options, self._user_outputs = session_options, list(user_outputs)
        self._params, self._grads, self._flat_grads = params, grads, flat_grads
        self._frozen, self._constants = frozen, constants
        self._state = {**params, **frozen, **constants}
        self._written = {**frozen, **constants}  # what a forward's buffer writes (`<name>_updated`) are copied into
        self._scratch: torch.Tensor | None = None
        self._scratch_views: dict[str, torch.Tensor] = {}
        self._run_options = run_options(device, shrink_arena)
        self._max_shapes = max(1, int(max_shapes))
        self._train: OrderedDict[tuple, _ShapeSession] = OrderedDict()
        self._eval: OrderedDict[tuple, _ShapeSession] = OrderedDict()
        self._trimmed = False
        self._failed_run: Exception | None = None  # the last run's error, which `explain_failure` may explain
        self._generator = torch.Generator(device=device.torch_device)
        self._unused = frozenset(first.names.unused_inputs)  # inputs the first graph does not read: not fed
        # graph inputs the step feeds beside the user's (the loss scale): every graph takes them, whatever the shapes
        self._step_inputs = frozenset(step_inputs)
        self._dynamic = first.names.dynamic  # input -> {axis: class}: dims one graph serves at every size
        # what the symbolic graphs assume of those dims (an `if` on a size): a batch that breaks it gets its own graph
        self._guards: list[tuple[str, str]] = list(first.names.guards)
        self._holds: dict[tuple, bool] = {}  # sizes -> whether every guard holds (shapes recur: checked once each)
        self._told_guards: set[str] = set()
        self._first = _first_signature(first)
        self._train[self._first] = _ShapeSession(self, first, training=True)

    # ---------------------------------------------------------------- the interface `engine._step` uses
    @property
    def train_input_names(self) -> list[str]:
        return [i.name for i in next(iter(self._train.values())).session.get_inputs()]

    def eval_graph(self) -> onnx.ModelProto:
        """A copy of the eval graph of the first input signature, constants as initializers (``save_as_onnx``)."""
        if self._eval:  # the most recent eval graph
            session = next(reversed(self._eval.values()))
        else:
            session = self._session_for(self._eval, self._first, training=False, inputs=None)
        model = onnx.ModelProto()
        model.CopyFrom(session.graphs.model)
        names = {i.name for i in model.graph.input}
        kept = [i for i in model.graph.input if i.name not in self._constants]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        for name, value in self._constants.items():
            if name in names:
                model.graph.initializer.append(numpy_helper.from_array(value.detach().cpu().numpy(), name))
        return model

    def explain_failure(self, inputs: Mapping[str, torch.Tensor], error: Exception) -> Exception | None:
        """A failed run (a label out of range...) explained by PyTorch on the same inputs, naming the input. Only
        ONNX Runtime's own failures are (`_run`): a graph build's error is the build's to tell."""
        failed, self._failed_run = self._failed_run, None  # its traceback holds the run's tensors: let it go
        if self._explain is None or error is not failed:
            return None
        return self._explain(inputs, error)

    def seed_step(self, seed: int) -> None:
        """Seed this step's random draws (called before every training run that draws: `engine._step`)."""
        self._generator.manual_seed(seed)

    def rebind_state(self) -> None:
        """Bind the state and gradient buffers again: their storage moved in place (`engine._bindings`)."""
        for shape in (*self._train.values(), *self._eval.values()):
            shape.bind_state(self._state)

    def run_train(self, inputs: Mapping[str, torch.Tensor], reset_grad: bool) -> dict[str, torch.Tensor]:
        """One forward + backward; gradients overwrite the buffer (``reset_grad``) or are added to it."""
        shape = self._session_for(self._train, self._signature(inputs), training=True, inputs=inputs)
        shape.fill_random(self._generator, self._sizes(inputs))
        if reset_grad:
            shape.bind_gradients(self._grads, "grads")
        else:
            shape.bind_gradients(self._scratch_targets(), "scratch")
        outputs = self._run(shape, inputs)
        if not reset_grad:
            self._flat_grads.add_(self._scratch)
        for name, output in shape.updated:
            self._written[name].copy_(outputs[output])
        if not self._trimmed:  # the first run's scratch, which glibc would keep resident (see TrainingSession)
            self._trimmed = True
            release_freed_memory(collect=False)  # native memory: no Python garbage to collect
        return {name: outputs[name] for name in self._user_outputs if name in outputs}

    def run_eval(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shape = self._session_for(self._eval, self._signature(inputs), training=False, inputs=inputs)
        outputs = self._run(shape, inputs)
        for name, output in shape.updated:
            self._written[name].copy_(outputs[output])
        return {name: outputs[name] for name in self._user_outputs if name in outputs}

    # ---------------------------------------------------------------- internals
    def _signature(self, inputs: Mapping[str, torch.Tensor]) -> tuple:
        """The graph ``inputs`` need: the name, shape (a symbolic dim by its class) and dtype of each input the
        first graph reads."""
        fed = {n: t for n, t in inputs.items() if n not in self._unused and n not in self._step_inputs}
        return _signature(fed, self._dynamic if self._guards_hold(inputs) else {})

    def _guards_hold(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Whether this batch's sizes keep what the symbolic graphs assumed (``graph.autograd.broken_guard``); a
        batch that breaks it is keyed by its concrete shape, so it gets a graph of its own (said once a guard)."""
        if not self._guards:
            return True
        sizes = self._sizes(inputs)
        key = tuple(sorted(sizes.items()))
        held = self._holds.get(key)
        if held is None:
            broken = broken_guard(self._guards, sizes)
            held = self._holds[key] = broken is None
            if broken is not None and broken[0] not in self._told_guards:
                self._told_guards.add(broken[0])
                warnings.warn(
                    f"the model's code assumes {broken[0]} of its symbolic input dims (at {broken[1]}), which the "
                    f"batch sizes {dict(sizes)} break: the autograd engine builds a graph for this shape",
                    UserWarning,
                    stacklevel=6,
                )
        return held

    def _sizes(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """This batch's size of each symbolic dim class (what the random draws are sized by)."""
        return {
            label: int(inputs[name].shape[axis])
            for name, axes in self._dynamic.items()
            if name in inputs
            for axis, label in axes.items()
        }

    def _session_for(self, sessions: OrderedDict, signature: tuple, *, training: bool, inputs) -> _ShapeSession:
        found = sessions.get(signature)
        if found is not None:
            sessions.move_to_end(signature)
            return found
        what = "training" if training else "eval"
        if sessions:
            _log.info("autograd engine: new input shapes %s, building the %s graph for them", signature, what)
        progress = BuildProgress(1, f"ORTTrainer {what} graph")
        with progress.phase(f"{what} graph for input shapes {[list(s) for _, s, _ in signature]}"):
            graphs = self._build(inputs, training)
            found = _ShapeSession(self, graphs, training=training)
        progress.close()
        new_guards = [g for g in graphs.names.guards if g not in self._guards]
        if new_guards:  # an eval graph's own assumptions count too
            self._guards += new_guards
            self._holds.clear()
        sessions[signature] = found
        while len(sessions) > self._max_shapes:
            sessions.popitem(last=False)
        return found

    def _scratch_targets(self) -> dict[str, torch.Tensor]:
        """Views of a zeroed scratch buffer laid out like the flat gradient buffer (made once)."""
        if self._scratch is None:
            self._scratch = torch.zeros_like(self._flat_grads)
            base, size = self._flat_grads.data_ptr(), self._flat_grads.element_size()
            for name, view in self._grads.items():
                offset = (view.data_ptr() - base) // size
                self._scratch_views[name] = self._scratch[offset : offset + view.numel()].view(view.shape)
        return self._scratch_views

    def _run(self, shape: _ShapeSession, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The run's outputs; a failed run is kept for `explain_failure` (the step asks it)."""
        try:
            return self._run_bound(shape, inputs)
        except Exception as error:
            self._failed_run = error
            raise

    def _run_bound(self, shape: _ShapeSession, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep_alive = []
        io = shape.io
        for name, tensor in inputs.items():
            if name not in shape.input_names:
                continue
            tensor = tensor.contiguous()
            keep_alive.append(tensor)
            io.bind_ortvalue_input(name, to_ortvalue(tensor))
        fresh = shape.out.prepare()
        shape.session.run_with_iobinding(shape.io, self._run_options)
        del keep_alive
        return shape.out.collect(fresh)


def _signature(feeds: Mapping[str, torch.Tensor], dynamic: Mapping[str, Mapping[int, str]]) -> tuple:
    """What a graph is specialised on: each fed input's name, shape (symbolic dims by class) and dtype."""
    return tuple((name, signature_shape(t.shape, dynamic.get(name)), t.dtype) for name, t in feeds.items())


def _first_signature(graphs: AutogradGraphs) -> tuple:
    feeds = {n: t for n, t in graphs.inputs.items() if n not in graphs.names.unused_inputs}
    return _signature(feeds, graphs.names.dynamic)
