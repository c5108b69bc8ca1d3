"""The flat buffers' layout on a GPU: every parameter starts on a 256-byte boundary (cuDNN refuses a convolution
weight at an odd offset: CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, seen on an H100). The aligned layout is forced
here on the CPU: it must train exactly as the packed one, and checkpoints move between the two layouts."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.optim import FlatLayout
from tests.models import CNN, CNN_DESC, cnn_batches


def test_an_aligned_layout_starts_every_slot_on_the_boundary_and_leaves_zero_gaps():
    layout = FlatLayout([("a", (3,)), ("b", (2, 5)), ("c", (64,)), ("d", (1,))], align=16)
    assert [s.offset for s in layout.slots] == [0, 16, 32, 96]
    assert layout.numel == 97
    buffer = torch.zeros(layout.numel)
    for view in layout.views(buffer).values():
        view.fill_(1.0)
    assert int(buffer.sum()) == 3 + 10 + 64 + 1  # the views cover the slots, nothing of the gaps
    assert [s.offset for s in FlatLayout([("a", (3,)), ("b", (5,))]).slots] == [0, 3]  # packed by default


@pytest.mark.parametrize("align", [0, -4, 2.0, True])
def test_a_bad_alignment_is_refused(align):
    with pytest.raises(ValueError, match=rf"align must be a positive int \(elements\), got {align!r}"):
        FlatLayout([("a", (3,))], align=align)


def _trainer(model):
    return ORTTrainer(
        model,
        CNN_DESC,
        optim.AdamConfig(lr=1e-2),
        loss_fn=torch.nn.functional.cross_entropy,
        options={"utils": {"engine": "autograd"}},
    )


def test_the_gpu_layout_trains_exactly_as_the_packed_one_and_checkpoints_cross(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = CNN()
    batches = cnn_batches(4)
    packed = _trainer(copy.deepcopy(model))
    packed_losses = [packed.train_step(*b).item() for b in batches[:2]]
    store_module = sys.modules["ort_trainer.engine._store"]
    monkeypatch.setattr(store_module, "_alignment", lambda device, sharded: store_module._GPU_ALIGN)
    aligned = _trainer(copy.deepcopy(model))
    aligned_losses = [aligned.train_step(*b).item() for b in batches[:2]]
    assert aligned_losses == packed_losses
    store = aligned.trainer_state.store
    assert store.layout.numel > sum(v.numel() for v in store.param_views.values())  # there are gaps
    gaps = torch.ones(store.padded_params.numel(), dtype=torch.bool)
    for slot in store.layout.slots:
        gaps[slot.offset : slot.offset + slot.numel] = False
    assert torch.count_nonzero(store.padded_params[gaps]) == 0  # the gaps and the padding hold zeros, never garbage
    for buffer, views in ((store.params, store.param_views), (store.grads, store.grad_views)):
        # 256 bytes from the buffer's start (torch's CUDA allocator starts a buffer on a 512-byte boundary)
        assert all((view.data_ptr() - buffer.data_ptr()) % 256 == 0 for view in views.values())
    packed.save_checkpoint(tmp_path / "packed.ortcp")
    aligned.load_checkpoint(tmp_path / "packed.ortcp")  # a CPU run's checkpoint resumed on a GPU
    assert [aligned.train_step(*b).item() for b in batches[2:]] == [packed.train_step(*b).item() for b in batches[2:]]
    weights = aligned.state_dict(pytorch_format=True)
    for key, value in packed.state_dict(pytorch_format=True).items():
        # the losses are bit-equal; the weights within one float32 rounding: since the convolution's weight gradient
        # is one convolution over the batch (symbolic shapes), ONNX Runtime's CPU kernels round a few of fc.weight's
        # elements (37 of 432, 7e-9) differently by the third step when the buffers sit at other offsets
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-8, msg=key)
