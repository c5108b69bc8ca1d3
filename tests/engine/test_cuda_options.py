"""What the trainer asks of ONNX Runtime's CUDA EP (checked on an H100 with benchmarks/gpu.py; no GPU here, so
torch's and ORT's CUDA queries are answered by the test): ORT's kernels run on torch's current stream, a run does
not wait for the GPU at its end, the arena grows by what a run asks for, and the user's provider options win."""

from __future__ import annotations

import pytest
import torch

from ort_trainer.runtime import _devices, _outputs

STREAM = 0x7F00DEAD


class _Stream:
    cuda_stream = STREAM


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(
        _devices.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: _Stream())


def test_cuda_runs_on_torchs_stream_with_an_arena_that_grows_as_asked(fake_cuda):
    spec = _devices.resolve_device("cuda:1")
    (name, options), cpu = spec.providers
    assert (name, cpu) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert options == {
        "device_id": 1,
        "arena_extend_strategy": "kSameAsRequested",
        "has_user_compute_stream": "1",
        "user_compute_stream": str(STREAM),
    }
    assert spec.torch_device == torch.device("cuda", 1)
    run = _outputs.run_options(spec, shrink_arena=False)
    assert run.get_run_config_entry("disable_synchronize_execution_providers") == "1"


def test_the_users_cuda_provider_options_win(fake_cuda):
    mine = {"arena_extend_strategy": "kNextPowerOfTwo", "user_compute_stream": "42", "use_tf32": "0"}
    (_, options), _ = _devices.resolve_device("cuda", {"CUDAExecutionProvider": mine}).providers
    assert options["device_id"] == 0
    assert {k: options[k] for k in mine} == mine


def test_a_cpu_run_keeps_onnxruntimes_synchronisation():
    run = _outputs.run_options(_devices.resolve_device("cpu"), shrink_arena=False)
    with pytest.raises(RuntimeError):  # no such entry: ORT's default (synchronise) applies
        run.get_run_config_entry("disable_synchronize_execution_providers")
