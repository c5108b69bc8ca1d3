"""The onnxblock engine's sessions: its training/eval graphs run in ONNX Runtime over our flat torch buffers.

`TrainingSession` is the modern stand-in for the legacy backend session (the graphs come from
`_onnxblock_graphs`; the autograd engine's session is `_autograd_session`). Parameters and gradient
buffers are views of two flat torch tensors, handed to ONNX Runtime zero-copy through DLPack and
bound once to an `IOBinding`; a step binds only the user inputs and the outputs it hands out
(`_OutputBinding`), then runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ort_trainer.diagnosis import quiet_native_info_logs
from ort_trainer.graph import BatchNormStats, strip_batchnorm_statistics

from ._dlpack import from_ortvalue, to_ortvalue
from ._fork_safety import track
from ._memory import release_freed_memory
from ._progress import BuildProgress
from ._random import draws_randomness

__all__ = ["DeviceSpec", "TrainingSession", "from_ortvalue", "resolve_device", "to_ortvalue"]

_LAZY_RESET = "lazy_reset_grad"
_ACCUMULATOR_FLAG = "_grad.accumulation.out"  # onnxblock's InPlaceAccumulatorV2 outputs


@dataclass(frozen=True)
class DeviceSpec:
    """Where buffers live and which execution providers run the graphs."""

    torch_device: torch.device
    providers: list

    @property
    def binding_type(self) -> str:
        return "cuda" if self.torch_device.type == "cuda" else "cpu"

    @property
    def binding_id(self) -> int:
        return self.torch_device.index or 0


def resolve_device(device_id: str, provider_options: Mapping[str, Mapping] | None = None) -> DeviceSpec:
    """Map ``options.device.id`` ("cpu", "cuda", "cuda:N") to a torch device and ORT providers."""
    provider_options = dict(provider_options or {})
    if device_id == "cpu":
        cpu_opts = dict(provider_options.get("CPUExecutionProvider", {}))
        return DeviceSpec(torch.device("cpu"), [("CPUExecutionProvider", cpu_opts)])
    index = int(device_id.split(":", 1)[1]) if ":" in device_id else 0
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(
            f"options.device.id={device_id!r} needs ONNX Runtime's CUDAExecutionProvider, but this onnxruntime "
            f"build only has {available}; install onnxruntime-gpu (in place of onnxruntime) or use device.id='cpu'"
        )
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise RuntimeError(f"options.device.id={device_id!r}: torch sees {torch.cuda.device_count()} CUDA devices")
    cuda_opts = {
        "device_id": index,
        # the arena grows by what a run asks for: its default, the next power of two, held 2.4x PyTorch's
        # memory on GPT-2 124M (8274 vs 3472 MiB, H100, batch 8 x 128)
        "arena_extend_strategy": "kSameAsRequested",
        **_torch_stream(index),
        **provider_options.get("CUDAExecutionProvider", {}),
    }
    return DeviceSpec(torch.device("cuda", index), [("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"])


def _torch_stream(index: int) -> dict[str, str]:
    """Run ONNX Runtime's kernels on torch's current stream of device ``index`` (its default one, usually).

    The flat buffers are written by torch (the optimizer's update, a user's ``copy_``) and read by ORT, and the
    gradients the other way round. On one stream these are ordered by the GPU itself; on ORT's own stream (a
    non-blocking one, which does not wait for torch's default stream) the next run could read weights the
    update has not written yet, unless every step waited on the host. With one stream, a run needs no
    synchronisation at its end either (`_run_options`). The stream is the one current when the trainer is
    built; ``provider_options={"CUDAExecutionProvider": {"user_compute_stream": ...}}`` names another.
    """
    stream = torch.cuda.current_stream(index).cuda_stream
    return {"has_user_compute_stream": "1", "user_compute_stream": str(stream)}


_TORCH_DTYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}


class _OutputBinding:
    """Binds a session's outputs once, so that a run allocates only the outputs it hands out.

    Outputs nobody reads (the gradient accumulators' flags) are bound once to scratch memory. The ones
    read after the run (``read``) need fresh memory every run, since the caller may keep last step's
    tensors: scalars (the loss) are bound to a new ``torch.empty(())`` (no ORT allocation, no output
    conversion); the others, whose declared shapes may be wrong where the exporter baked a dimension in,
    are allocated by ORT (rebinding the name drops last run's buffer) and picked from the binding's
    outputs, whose order is the order of first binding.
    """

    def __init__(self, session: ort.InferenceSession, io: ort.IOBinding, device: DeviceSpec, read: set[str]):
        self._io, self._device = io, device
        self._static: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._dynamic: list[tuple[str, int]] = []  # (name, position among the bound outputs)
        self._scratch: list[torch.Tensor] = []  # kept alive: ORT writes into them
        for position, output in enumerate(session.get_outputs()):
            shape, dtype = output.shape, _TORCH_DTYPES.get(output.type)
            static = dtype is not None and all(isinstance(d, int) for d in shape)
            if output.name in read and static and not shape:
                self._static.append((output.name, (), dtype))
            elif output.name in read:
                self._dynamic.append((output.name, position))
            if static and output.name.endswith(_ACCUMULATOR_FLAG):  # bound once, in graph order
                self._scratch.append(torch.empty(shape, dtype=dtype, device=device.torch_device))
                io.bind_ortvalue_output(output.name, to_ortvalue(self._scratch[-1]))
            else:
                io.bind_output(output.name, device.binding_type, device.binding_id)

    def prepare(self) -> dict[str, torch.Tensor]:
        """Bind fresh memory for the outputs to be read; returns the ones preallocated here."""
        fresh = {}
        for name, shape, dtype in self._static:
            fresh[name] = torch.empty(shape, dtype=dtype, device=self._device.torch_device)
            self._io.bind_ortvalue_output(name, to_ortvalue(fresh[name]))
        for name, _ in self._dynamic:
            self._io.bind_output(name, self._device.binding_type, self._device.binding_id)
        return fresh

    def collect(self, fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """After the run: the preallocated outputs plus the ones ORT allocated."""
        if self._dynamic:
            values = self._io._iobinding.get_outputs()
            for name, position in self._dynamic:
                fresh[name] = from_ortvalue(values[position])
        return fresh


def _run_options(device: DeviceSpec, shrink_arena: bool) -> ort.RunOptions:
    """``utils.shrink_memory_arena`` on CPU: the arena's free chunks go back to the OS after every run.

    ONNX Runtime's CPU arena keeps the largest set of activations a run ever needed for the life of
    the session (GPT-2 124M, batch 2x128: ~0.6 GiB) though nothing lives there between steps, where
    PyTorch's allocator returns its activations. Shrinking the arena at the end of each run brings
    steady RSS down to weights, gradients and moments, at the price of fresh pages every step.
    """
    options = ort.RunOptions()
    if shrink_arena and device.torch_device.type == "cpu":
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    if device.torch_device.type == "cuda":  # ORT runs on torch's stream (`_torch_stream`): no host wait per run
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


class TrainingSession:
    """Owns the ORT sessions and their bindings over the trainer's buffers."""

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
        self._train_out = _OutputBinding(self._train, self._train_io, device, self._read)
        self._eval = self._eval_io = self._eval_out = None  # created by the first eval step (_ensure_eval)
        self._run_options = _run_options(device, shrink_arena)
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
            self._eval_out = _OutputBinding(session, io, self._device, self._read)
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
    def _run(session, io, inputs, out: _OutputBinding, run_options) -> dict[str, torch.Tensor]:
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
