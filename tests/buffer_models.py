"""Models whose buffers are not float state of the ``state_dict`` (an integer step counter, a non-persistent
temperature, a count the forward keeps), shared by tests/engine/test_written_buffers.py and
tests/checkpoint/test_checkpoint_buffers.py."""

from __future__ import annotations

import torch

__all__ = ["AUTOGRAD", "DESC", "Counting", "Tempered", "batches", "ce"]

ce = torch.nn.functional.cross_entropy
DESC = {"inputs": [("x", ["batch", 4]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
# the onnxblock engine exports integer buffers as graph constants (and refuses a model that has one): autograd's
AUTOGRAD = {"utils": {"engine": "autograd"}}


class Tempered(torch.nn.Module):
    """Logits scaled by a non-persistent float buffer, shifted by a term of a persistent int buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("temperature", torch.tensor(1.0), persistent=False)
        self.register_buffer("step_count", torch.tensor(0, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = self.step_count.to(x.dtype) * 0.25 * torch.arange(3, dtype=x.dtype)
        return self.fc(x) * self.temperature + shift


class Counting(torch.nn.Module):
    """A forward that counts its own calls in an int buffer (as BatchNorm's ``num_batches_tracked``) and reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("calls", torch.tensor(0, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc(x) * (1.0 + 0.1 * self.calls.to(x.dtype))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for _ in range(steps)
    ]
