"""Mixed precision: fp16 where the provider supports it, loss scaling, skipped overflow steps, scaler state."""

from __future__ import annotations

import pytest
import torch

import ort_trainer.engine.onnxblock._build as build
from ort_trainer import ORTTrainer, amp, optim
from tests.models import LM_DESC, MLP, MLP_DESC, TinyLM, lm_batches, lm_loss, mlp_batches

ce = torch.nn.functional.cross_entropy


def _mlp(mixed: bool, scaler=None, **extra):
    torch.manual_seed(0)
    options = {"mixed_precision": {"enabled": True, "loss_scaler": scaler}} if mixed else {}
    return ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=ce, options={**options, **extra} or None)


def test_cpu_provider_runs_fp32_kernels_so_mixed_precision_equals_fp32():
    """The CPU EP has no fp16 MatMul/Gemm/Add kernels (probed, not assumed), so every node stays fp32:
    only the loss scaling differs, and unscaling by a power of two is exact."""
    fp32, mixed = _mlp(False), _mlp(True)
    for batch in mlp_batches(10):
        torch.testing.assert_close(mixed.train_step(*batch), fp32.train_step(*batch), atol=0, rtol=0)
    a, b = fp32.state_dict(), mixed.state_dict()
    for name, value in a["model"]["full_precision"].items():
        torch.testing.assert_close(b["model"]["full_precision"][name], value, atol=1e-7, rtol=1e-6)
    assert b["trainer_options"]["mixed_precision"] is True
    assert b["loss_scaler"]["loss_scale"] == 65536.0
    assert "loss_scaler" not in a


def test_forced_fp16_graph_trains_close_to_fp32(monkeypatch):
    """Mark every op fp16-capable (what a CUDA provider reports): ORT then rounds every tensor through
    float16 on this CPU. fp16 keeps ~11 bits (relative rounding 4.9e-4 per op); over 20 steps of a small
    transformer the loss curve stays within 2% of fp32."""
    monkeypatch.setattr(
        build, "provider_fp16_support", lambda providers, ops: dict.fromkeys(((d, o) for d, o, *_ in ops), True)
    )
    curves = {}
    for mixed in (False, True):
        torch.manual_seed(0)
        options = {"mixed_precision": {"enabled": True}} if mixed else None
        trainer = ORTTrainer(
            TinyLM(), LM_DESC, optim.AdamConfig(lr=3e-3, epsilon=1e-6), loss_fn=lm_loss, options=options
        )
        curves[mixed] = torch.tensor([trainer.train_step(*b).item() for b in lm_batches(20)])
    torch.testing.assert_close(curves[True], curves[False], rtol=2e-2, atol=0)
    assert curves[True][-5:].mean() < curves[True][:5].mean()  # and it does learn


def test_overflow_skips_the_step_and_halves_the_scale():
    scaler = amp.DynamicLossScaler(loss_scale=3e38)  # loss * scale overflows float32
    trainer = _mlp(True, scaler)
    before = trainer.state_dict()
    batches = mlp_batches(3)
    trainer.train_step(*batches[0])
    after = trainer.state_dict()
    info = trainer.train_step_info
    assert info.all_finite is False and info.optimization_step == 0 and info.step == 1
    assert scaler.loss_scale == pytest.approx(1.5e38)
    for name, value in before["model"]["full_precision"].items():
        assert torch.equal(after["model"]["full_precision"][name], value), name
    for name, entry in after["optimizer"].items():
        assert entry["Update_Count"].item() == 1 and not entry["Moment_1"].any(), name
    scaler.loss_scale = 1024.0  # a sane scale: training proceeds
    trainer.train_step(*batches[1])
    assert info.all_finite is True and info.optimization_step == 1


def test_resume_keeps_the_loss_scaler_state(tmp_path):
    def make():
        return _mlp(True, amp.DynamicLossScaler(loss_scale=1024.0, up_scale_window=2))

    full = make()
    for batch in mlp_batches(8):
        full.train_step(*batch)
    first = make()
    for batch in mlp_batches(4):
        first.train_step(*batch)
    first.save_checkpoint(tmp_path / "mp.ortcp")
    resumed = make()
    resumed.load_checkpoint(tmp_path / "mp.ortcp")
    for batch in mlp_batches(8)[4:]:
        resumed.train_step(*batch)
    a, b = full.state_dict(), resumed.state_dict()
    assert a["loss_scaler"] == b["loss_scaler"] and a["loss_scaler"]["loss_scale"] == 1024.0 * 16
    for name, value in a["model"]["full_precision"].items():
        assert torch.equal(b["model"]["full_precision"][name], value), name


def test_loss_scaler_without_enabled_is_rejected():
    with pytest.raises(ValueError, match="Loss Scaler cannot be specified when Mixed Precision is not enabled"):
        ORTTrainer(
            MLP(),
            MLP_DESC,
            optim.AdamConfig(),
            loss_fn=ce,
            options={"mixed_precision": {"loss_scaler": amp.DynamicLossScaler()}},
        )
