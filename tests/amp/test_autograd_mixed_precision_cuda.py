"""Mixed precision on the autograd engine on a CUDA GPU: what only a GPU can show (docs/engines.md).

The CPU tests (test_autograd_mixed_precision.py) check the float16 graph by letting ONNX Runtime's CPU provider
run it as float32 kernels behind casts. Here the CUDA provider runs the float16 and bfloat16 kernels themselves,
against ``torch.autocast("cuda")`` (+ ``torch.amp.GradScaler`` for float16) on the same GPU. These tests need the
hardware (torch with CUDA and onnxruntime-gpu's CUDAExecutionProvider); everywhere else they are skipped.
"""

from __future__ import annotations

import logging
import warnings

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from ort_trainer import ORTTrainer, amp, optim
from tests.models import LM_DESC, TinyLM, lm_batches, lm_loss

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()),
    reason="needs a CUDA GPU and onnxruntime-gpu (CUDAExecutionProvider)",
)

_ELEM = {torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}


def _pair(dtype: torch.dtype, scale: float, tmp_path):
    torch.manual_seed(0)
    model, reference = TinyLM(), TinyLM().cuda()
    reference.load_state_dict(model.state_dict())
    scaler = amp.DynamicLossScaler(loss_scale=scale, up_scale_window=3)
    options = {
        "device": {"id": "cuda"},
        "utils": {"engine": "autograd", "grad_norm_clip": False},
        "mixed_precision": {"enabled": True, "loss_scaler": scaler, "dtype": str(dtype).removeprefix("torch.")},
        "debug": {"graph_save_paths": {"model_with_training_graph_path": str(tmp_path / "train.onnx")}},
    }
    trainer = ORTTrainer(model, LM_DESC, optim.SGDConfig(lr=0.5), loss_fn=lm_loss, options=options)
    return trainer, reference, scaler


def _reference_step(model, opt, scaler, batch, dtype):
    opt.zero_grad()
    with torch.autocast("cuda", dtype=dtype):
        loss = lm_loss(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach().float()


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_low_precision_kernels_train_as_autocast_with_gradscaler(dtype, rtol, tmp_path, caplog):
    """Losses within the dtype's rounding of PyTorch's autocast loop on the same GPU, the loss scale on the same
    trajectory (GradScaler also scales bf16 here: by a power of two, exact in bf16's float32 range), products in
    the low-precision dtype on the CUDA provider, gradients float32."""
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        trainer, reference, scaler = _pair(dtype, 2.0**10, tmp_path)
        opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        torch_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
        losses, expected = [], []
        for batch in lm_batches(7):
            cuda_batch = [t.cuda() for t in batch]
            losses.append(trainer.train_step(*cuda_batch).float())
            expected.append(_reference_step(reference, opt, torch_scaler, cuda_batch, dtype))
            assert scaler.loss_scale == torch_scaler.get_scale()
    assert f"the graphs compute in {str(dtype).removeprefix('torch.')} (torch.autocast)" in caplog.text
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=rtol, atol=0)
    model = onnx.load(tmp_path / "train.onnx")
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    products = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert sum(types.get(n.output[0]) == _ELEM[dtype] for n in products) >= 8
    assert {types[n + "_grad"] for n, _ in reference.named_parameters()} == {TensorProto.FLOAT}


def test_fp16_overflow_is_skipped_on_the_gpu_as_gradscaler_skips_it(tmp_path):
    trainer, reference, scaler = _pair(torch.float16, 2.0**24, tmp_path)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24, growth_interval=3)
    finite = []
    for batch in lm_batches(8):
        cuda_batch = [t.cuda() for t in batch]
        trainer.train_step(*cuda_batch)
        _reference_step(reference, opt, torch_scaler, cuda_batch, torch.float16)
        assert scaler.loss_scale == torch_scaler.get_scale()
        finite.append(trainer.train_step_info.all_finite)
    assert finite[0] is False and finite[-1] is True
    assert trainer.train_step_info.optimization_step == finite.count(True)


def test_a_mixed_precision_step_waits_for_the_gpu_once(tmp_path):
    """The loss scale is fed from a device tensor filled only when it changes; the one wait per update is the
    finiteness check's read of the gradient norm (as ``GradScaler.step`` reads ``found_inf``)."""
    trainer, _, _ = _pair(torch.float16, 2.0**10, tmp_path)
    batches = [[t.cuda() for t in batch] for batch in lm_batches(4)]
    for batch in batches[:2]:
        trainer.train_step(*batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in batches[2:]:
                trainer.train_step(*batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) <= 2, [str(w.message) for w in waits]
