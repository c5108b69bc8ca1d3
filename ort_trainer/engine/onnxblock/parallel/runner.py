"""`ParallelSession`: runs a rank's segments with the horizontal group's collectives between them.

Forward: segments in order; before segment ``k``, the markers whose output it is the first to read:
g (``REDUCE_OP``) all-reduces its input over the horizontal group, f (``COPY_OP``) passes it on.
Backward: segments in reverse, each fed its saved boundary inputs and the upstream gradients of its
outputs (the loss: 1); parameter gradients are added into the trainer's gradient buffers, input
gradients summed per value; after segment ``k``, f all-reduces the gradient of its output and hands
it to its input, g hands it on unchanged. Same interface as the engine's ``TrainingSession``
(``run_train`` / ``run_eval``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import onnx
import onnxruntime as ort
import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

from ort_trainer.graph.onnxblock import unseal_no_gradient_copies
from ort_trainer.runtime import DeviceSpec, quiet_native_info_logs, to_ortvalue, track

from .markers import COPY_OP
from .segments import UPSTREAM_SUFFIX, SegmentedGraph

__all__ = ["ParallelSession"]


class _Runner:
    """One ONNX model in an InferenceSession, run over torch tensors (zero-copy in, ORT-allocated out)."""

    def __init__(self, model, options: ort.SessionOptions, device: DeviceSpec):
        with quiet_native_info_logs():
            self.session = track(ort.InferenceSession(model.SerializeToString(), options, device.providers))
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self._bool = {o.name for o in self.session.get_outputs() if o.type == "tensor(bool)"}
        self.device = device

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        io = self.session.io_binding()
        keep = []
        for name in self.inputs:
            tensor = feeds[name].contiguous()
            keep.append(tensor)
            io.bind_ortvalue_input(name, to_ortvalue(tensor))
        for name in self.outputs:
            io.bind_output(name, self.device.binding_type, self.device.binding_id)
        self.session.run_with_iobinding(io)
        values = io._iobinding.get_outputs()
        out = {name: from_dlpack(v.to_dlpack()) for name, v in zip(self.outputs, values, strict=True)}
        for name in self._bool:  # DLPack hands ORT's bool tensors over as uint8
            out[name] = out[name].view(torch.bool) if out[name].dtype == torch.uint8 else out[name]
        return out


class ParallelSession:
    """Forward/backward of the segments of one rank, with the f/g all-reduces over ``group``."""

    draws_randomness = False  # dropout that is on is refused (`segments`): nothing to reseed before a run

    def __init__(
        self,
        forward: onnx.ModelProto,
        graph: SegmentedGraph,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        frozen: Mapping[str, torch.Tensor],
        loss: str,
        user_outputs: Sequence[str],
        device: DeviceSpec,
        session_options: ort.SessionOptions,
        group,
    ):
        self._graph, self._group, self._loss = graph, group, loss
        self._eval_model = forward  # this rank's forward graph, whole: its eval graph (``save_as_onnx``)
        self._state = {**params, **frozen}
        self._grads = grads
        self._user_outputs = list(user_outputs)
        self._forward = [_Runner(s.forward, session_options, device) for s in graph.segments]
        self._backward = [
            _Runner(s.backward, session_options, device) if s.backward is not None else None for s in graph.segments
        ]

    @property
    def train_input_names(self) -> list[str]:
        return list(self._graph.graph_inputs)

    def seed_step(self, seed: int) -> None:
        """Nothing to seed (``draws_randomness`` is False)."""

    def rebind_state(self) -> None:
        """Nothing to rebind: the segments bind the state at every run."""

    def eval_graph(self) -> onnx.ModelProto:
        """A copy of this rank's forward graph, its stop-gradient copies as ``Identity``."""
        model = copy.deepcopy(self._eval_model)
        unseal_no_gradient_copies(model)
        return model

    def explain_failure(self, inputs: Mapping[str, torch.Tensor], error: Exception) -> Exception | None:
        """None: the step's own checks explain a failed run."""
        return None

    def run_eval(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values = self._forward_pass(inputs)
        return {name: values[name] for name in self._user_outputs if name in values}

    def run_train(self, inputs: Mapping[str, torch.Tensor], reset_grad: bool) -> dict[str, torch.Tensor]:
        """Forward + backward; parameter gradients accumulate in the buffers (zeroed first if ``reset_grad``)."""
        values = self._forward_pass(inputs)
        if reset_grad:
            for grad in self._grads.values():
                grad.zero_()
        self._backward_pass(values)
        return {name: values[name] for name in self._user_outputs if name in values}

    def _forward_pass(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values = dict(inputs)
        for segment, runner in zip(self._graph.segments, self._forward, strict=True):
            for marker in self._graph.markers:
                if marker.segment <= segment.index and marker.output not in values:
                    values[marker.output] = self._marker_forward(marker.kind, values[marker.input])
            feeds = {**values, **self._state}
            values.update(runner.run(feeds))
        return values

    def _marker_forward(self, kind: str, value: torch.Tensor) -> torch.Tensor:
        if kind == COPY_OP:
            return value
        summed = value.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self._group)
        return summed

    def _backward_pass(self, values: dict[str, torch.Tensor]) -> None:
        upstream: dict[str, torch.Tensor] = {self._loss: torch.ones_like(values[self._loss])}
        for segment, runner in zip(reversed(self._graph.segments), reversed(self._backward), strict=True):
            if runner is not None:
                feeds = {**values, **self._state}
                for name in segment.upstream:
                    feeds[name + UPSTREAM_SUFFIX] = upstream.get(name, _zeros(values[name]))
                results = runner.run(feeds)
                for name in segment.params:
                    self._grads[name].add_(results[f"{name}_grad"])
                for name in segment.grad_inputs:
                    _accumulate(upstream, name, results[f"{name}_grad"])
            for marker in self._graph.markers:
                if marker.segment >= segment.index and marker.output in upstream:
                    grad = upstream.pop(marker.output)
                    if marker.kind == COPY_OP:
                        grad = grad.clone()
                        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self._group)
                    _accumulate(upstream, marker.input, grad)


def _zeros(value: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(value)


def _accumulate(grads: dict[str, torch.Tensor], name: str, grad: torch.Tensor) -> None:
    grads[name] = grad if name not in grads else grads[name] + grad
