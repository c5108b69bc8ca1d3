"""Where a session runs: the torch device of its buffers and the ONNX Runtime execution providers.

`resolve_device` maps ``options.device.id`` ("cpu", "cuda", "cuda:N") to a `DeviceSpec`; on CUDA, ONNX Runtime runs
on torch's current stream (`_torch_stream`), so buffers written by torch and read by ORT need no host wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnxruntime as ort
import torch

__all__ = ["DeviceSpec", "resolve_device"]


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
