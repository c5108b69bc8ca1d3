"""The onnxblock engine's sessions: its training/eval graphs run in ONNX Runtime over our flat torch buffers.

`TrainingSession` (a `StepSession`) is the modern stand-in for the legacy backend session (the graphs come from
`_graphs`; the autograd engine's session is ``engine.autograd._session``). Parameters and gradient
buffers are views of two flat torch tensors, handed to ONNX Runtime zero-copy through DLPack and
bound once to an `IOBinding`; a step binds only the user inputs and the outputs it hands out
(`runtime.OutputBinding`), then runs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ort_trainer.graph.onnxblock import BatchNormStats, strip_batchnorm_statistics, unseal_no_gradient_copies
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
from .._random import draws_randomness

__all__ = ["TrainingSession"]

_LAZY_RESET = "lazy_reset_grad"
_ACCUMULATOR_FLAG = "_grad.accumulation.out"  # onnxblock's InPlaceAccumulatorV2 outputs


def _is_accumulator_flag(name: str) -> bool:
    """onnxblock's InPlaceAccumulatorV2 outputs: bound once to scratch memory, never read."""
    return name.endswith(_ACCUMULATOR_FLAG)


class TrainingSession:
    """Owns the ORT sessions and their bindings over the trainer's buffers (a `StepSession`)."""

    draws_randomness: bool  # the training graph has Dropout: reseeded before every run (`engine._random`)

    def __init__(
        self,
        train_model: onnx.ModelProto,
        eval_model: onnx.ModelProto,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        frozen: Mapping[str, torch.Tensor],
        bn_stats: Sequence[BatchNormStats],
        user_outputs: Sequence[str],
        device: DeviceSpec,
        session_options: ort.SessionOptions,
        shrink_arena: bool = False,
    ):
        self._device = device
        self._user_outputs = list(user_outputs)
        self._bn_stats = list(bn_stats)
        self._frozen = frozen
        self._trimmed = False  # one malloc_trim after the first training run (see run_train)
        self.draws_randomness = draws_randomness(train_model)  # Dropout: reseeded before every run (`_random`)
        strip_batchnorm_statistics(eval_model, self._bn_stats)
        self._eval_model, self._session_options = eval_model, session_options
        dump = session_options.optimized_model_filepath  # debug.graph_save_paths: the training graph's, only
        with quiet_native_info_logs():
            self._train = track(
                ort.InferenceSession(train_model.SerializeToString(), session_options, device.providers)
            )
        self._reset_flags = {flag: np.array([flag]) for flag in (True, False)}  # kept alive: ORT shares them
        self._reset_values = {flag: ort.OrtValue.ortvalue_from_numpy(a) for flag, a in self._reset_flags.items()}
        self._state, self._grads = {**params, **frozen}, grads
        self._train_io = self._bind_state(self._train, self._state, grads)
        self._read = set(self._user_outputs) | {
            name for s in self._bn_stats for name in (s.new_mean_output, s.new_var_output, s.input_shape_output)
        }
        self._train_out = OutputBinding(self._train, self._train_io, device, self._read, _is_accumulator_flag)
        self._eval = self._eval_io = self._eval_out = None  # created by the first eval step (_ensure_eval)
        self._run_options = run_options(device, shrink_arena)
        self._dump = dump

    def seed_step(self, seed: int) -> None:
        """Seed this step's Dropout masks: ONNX Runtime's default generator (`_random`)."""
        ort.set_seed(seed)

    def _ensure_eval(self) -> None:
        """Create the eval session on first use: a run that never evaluates never pays for it."""
        if self._eval is not None:
            return
        progress = BuildProgress(1, "ORTTrainer eval session")
        options = self._session_options
        with progress.phase("eval session"), quiet_native_info_logs():
            options.optimized_model_filepath = ""  # debug.graph_save_paths names the training graph's file only
            try:
                session = track(
                    ort.InferenceSession(self._eval_model.SerializeToString(), options, self._device.providers)
                )
            finally:
                options.optimized_model_filepath = self._dump
            io = self._bind_state(session, self._state, {})
            self._eval_out = OutputBinding(session, io, self._device, self._read, _is_accumulator_flag)
            self._eval, self._eval_io = session, io
        progress.close()

    @property
    def train_input_names(self) -> list[str]:
        return [i.name for i in self._train.get_inputs()]

    def _bind_state(self, session, state, grads, binding: ort.IOBinding | None = None) -> ort.IOBinding:
        binding = binding if binding is not None else session.io_binding()
        wanted = {i.name for i in session.get_inputs()}
        for name, tensor in state.items():
            if name in wanted:
                binding.bind_ortvalue_input(name, to_ortvalue(tensor))
        for name, tensor in grads.items():
            binding.bind_ortvalue_input(f"{name}_grad.accumulation.buffer", to_ortvalue(tensor))
        return binding

    def eval_graph(self) -> onnx.ModelProto:
        """A copy of the eval graph for any onnxruntime: its stop-gradient copies (an onnxruntime-training op)
        become ``Identity``."""
        model = copy.deepcopy(self._eval_model)
        unseal_no_gradient_copies(model)
        return model

    def explain_failure(self, inputs: Mapping[str, torch.Tensor], error: Exception) -> Exception | None:
        """None: the step's own checks (`diagnosis.explain_run_errors`) explain this engine's failures."""
        return None

    def rebind_state(self) -> None:
        """Bind the state and gradient buffers again: their storage moved in place (`engine._bindings`)."""
        self._bind_state(self._train, self._state, self._grads, self._train_io)
        if self._eval is not None:
            self._bind_state(self._eval, self._state, {}, self._eval_io)

    def run_train(self, inputs: Mapping[str, torch.Tensor], reset_grad: bool) -> dict[str, torch.Tensor]:
        """One forward+backward; gradients accumulate into the bound buffers (overwrite if ``reset_grad``)."""
        io = self._train_io
        io.bind_ortvalue_input(_LAZY_RESET, self._reset_values[bool(reset_grad)])
        outputs = self._run(self._train, io, inputs, self._train_out, self._run_options)
        if self._bn_stats:
            self._update_batchnorm_statistics(outputs)
        if not self._trimmed:
            # The first run initialises kernels and plans memory, freeing ~30 MB of scratch that glibc would
            # keep resident for the whole run (HF BERT: steady RSS 772 -> 743 MiB); give it back once.
            self._trimmed = True
            release_freed_memory()
        return {name: outputs[name] for name in self._user_outputs}

    def run_eval(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._ensure_eval()
        outputs = self._run(self._eval, self._eval_io, inputs, self._eval_out, self._run_options)
        return {name: outputs[name] for name in self._user_outputs if name in outputs}

    @staticmethod
    def _run(session, io, inputs, out: OutputBinding, run_options) -> dict[str, torch.Tensor]:
        keep_alive = []
        for name, tensor in inputs.items():
            tensor = tensor.contiguous()
            keep_alive.append(tensor)
            io.bind_ortvalue_input(name, to_ortvalue(tensor))
        fresh = out.prepare()
        session.run_with_iobinding(io, run_options)
        del keep_alive
        return out.collect(fresh)

    def _update_batchnorm_statistics(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """Write ORT's new running stats back, with PyTorch's unbiased variance (n/(n-1))."""
        for stat in self._bn_stats:
            mean, var = self._frozen[stat.running_mean], self._frozen[stat.running_var]
            shape = outputs[stat.input_shape_output].tolist()
            n = int(np.prod(shape)) // max(int(shape[1]), 1)
            kept = var * stat.momentum
            new_var = outputs[stat.new_var_output].to(var.device)
            if n > 1:
                new_var = kept + (new_var - kept) * (n / (n - 1))
            var.copy_(new_var)
            mean.copy_(outputs[stat.new_mean_output])
