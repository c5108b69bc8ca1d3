"""Output binding and run options shared by every session over torch buffers (both engines' training sessions).

`OutputBinding` binds a session's outputs once, so that a run allocates only the outputs it hands out;
`run_options` holds what every run of a session is given (arena shrinkage, no host wait on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import onnxruntime as ort
import torch

from ._devices import DeviceSpec
from ._dlpack import from_ortvalue, to_ortvalue

__all__ = ["OutputBinding", "run_options"]


_TORCH_DTYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}


class OutputBinding:
    """Binds a session's outputs once, so that a run allocates only the outputs it hands out.

    Outputs nobody reads (``scratch``: the onnxblock engine's gradient accumulators' flags) are bound once to
    scratch memory. The ones read after the run (``read``) need fresh memory every run, since the caller may keep
    last step's tensors: scalars (the loss) are bound to a new ``torch.empty(())`` (no ORT allocation, no output
    conversion); the others, whose declared shapes may be wrong where the exporter baked a dimension in,
    are allocated by ORT (rebinding the name drops last run's buffer) and picked from the binding's
    outputs, whose order is the order of first binding.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        io: ort.IOBinding,
        device: DeviceSpec,
        read: set[str],
        scratch: Callable[[str], bool] = lambda name: False,
    ):
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
            if static and scratch(output.name):  # bound once, in graph order
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


def run_options(device: DeviceSpec, shrink_arena: bool) -> ort.RunOptions:
    """``utils.shrink_memory_arena`` on CPU: the arena's free chunks go back to the OS after every run.

    ONNX Runtime's CPU arena keeps the largest set of activations a run ever needed for the life of
    the session (GPT-2 124M, batch 2x128: ~0.6 GiB) though nothing lives there between steps, where
    PyTorch's allocator returns its activations. Shrinking the arena at the end of each run brings
    steady RSS down to weights, gradients and moments, at the price of fresh pages every step.
    """
    options = ort.RunOptions()
    if shrink_arena and device.torch_device.type == "cpu":
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    if device.torch_device.type == "cuda":  # ORT runs on torch's stream (`_devices`): no host wait per run
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options
