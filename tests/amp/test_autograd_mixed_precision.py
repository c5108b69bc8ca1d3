"""Mixed precision on the autograd engine, against ``torch.autocast`` + ``torch.amp.GradScaler``.

ONNX Runtime's CPU provider has no float16 MatMul/Gemm kernels (probed), so on CPU the math stays float32 and only
the loss scaling is added: losses, weights and the scale's trajectory then equal a float32 PyTorch loop with a
GradScaler exactly. The float16 graph itself (the step traced under autocast) is checked on CPU by making the
probe report the kernels a CUDA provider has: ONNX Runtime then runs its float16 nodes as float32 kernels behind
casts it inserts, which rounds every tensor through float16 as PyTorch's CPU autocast does.
"""

from __future__ import annotations

import logging

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import ort_trainer.engine._assembly as assembly
import ort_trainer.engine.autograd._precision as precision_module
from ort_trainer import ORTTrainer, amp, optim
from ort_trainer.config.options import OptionsError
from ort_trainer.engine.autograd._precision import autograd_precision, report_fallbacks
from ort_trainer.graph.autograd import Precision
from tests.models import LM_DESC, MLP, MLP_DESC, TinyLM, lm_batches, lm_loss, mlp_batches

ce = torch.nn.functional.cross_entropy
CPU = ["CPUExecutionProvider"]


@pytest.fixture
def fp16_kernels(monkeypatch):
    """The CPU provider reports float16 kernels for every op (what the CUDA provider reports)."""
    monkeypatch.setattr(
        precision_module, "low_precision_support", lambda providers, ops, elem: {(d, o): True for d, o, *_ in ops}
    )


def _trainer(model, desc, loss_fn, config, scaler, **options):
    mixed = {"enabled": True, "loss_scaler": scaler, **options.pop("mixed", {})}
    options = {"utils": {"engine": "autograd"}, "mixed_precision": mixed, **options}
    return ORTTrainer(model, desc, config, loss_fn=loss_fn, options=options)


def _reference_step(model, opt, scaler, loss_fn, batch, autocast, clip=1.0):
    """One step of PyTorch's recipe: autocast forward, scaled backward, unscale, clip, step, update."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = loss_fn(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def _weights(trainer):
    return trainer.state_dict()["model"]["full_precision"]


def test_on_cpu_the_math_stays_float32_and_equals_a_float32_loop_with_gradscaler(caplog):
    """No float16 MatMul on the CPU provider: float32 graph + loss scaling, equal to PyTorch's float32 loop with a
    GradScaler to float32 rounding (scaling by a power of two is exact; clipping rounds differently), the scale
    growing on the same steps; the log says so."""
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    scaler = amp.DynamicLossScaler(loss_scale=2.0**10, up_scale_window=2)
    trainer = _trainer(model, MLP_DESC, ce, optim.AdamConfig(lr=0.01), scaler)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for batch in mlp_batches(6):
        with caplog.at_level(logging.INFO, logger="ort_trainer"):
            loss = trainer.train_step(*batch)
        expected = _reference_step(reference, opt, torch_scaler, ce, batch, autocast=False)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert scaler.loss_scale == torch_scaler.get_scale()
    assert scaler.loss_scale == 2.0**13
    assert "no float16 kernels for ['Gemm', 'MatMul'], so the math stays float32" in caplog.text
    for name, value in reference.named_parameters():
        torch.testing.assert_close(_weights(trainer)[name], value.detach(), rtol=0, atol=1e-6, msg=name)


def test_fp16_graph_trains_as_autocast_with_gradscaler(fp16_kernels, tmp_path):
    """A tiny transformer, float16 graph: losses within fp16 rounding of PyTorch's autocast loop, weights too
    (SGD: Adam would turn the fp16 noise of the key bias's zero gradient into whole steps), the loss scale grows
    on the same steps; the graph computes its products in float16 and returns float32 gradients."""
    torch.manual_seed(0)
    model, reference = TinyLM(), TinyLM()
    reference.load_state_dict(model.state_dict())
    scaler = amp.DynamicLossScaler(up_scale_window=3)
    graph = tmp_path / "train.onnx"
    trainer = _trainer(
        model,
        LM_DESC,
        lm_loss,
        optim.SGDConfig(lr=0.5),
        scaler,
        debug={"graph_save_paths": {"model_with_training_graph_path": str(graph)}},
    )
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    losses, expected = [], []
    for batch in lm_batches(7):
        losses.append(trainer.train_step(*batch))
        expected.append(_reference_step(reference, opt, torch_scaler, lm_loss, batch, autocast=True, clip=0))
        assert scaler.loss_scale == torch_scaler.get_scale()
    assert scaler.loss_scale == 2.0**18
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-3, atol=0)
    assert losses[-1] < losses[0]
    for name, value in reference.named_parameters():
        torch.testing.assert_close(_weights(trainer)[name], value.detach(), rtol=0, atol=2e-3, msg=name)
    model_proto = onnx.load(graph)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model_proto.graph.value_info, *model_proto.graph.output]}
    half_products = [
        n for n in model_proto.graph.node if n.op_type in ("MatMul", "Gemm") and types.get(n.output[0]) == 10
    ]
    assert len(half_products) >= 8  # the four projections, the FFN and the head, forward and backward
    assert {types[n + "_grad"] for n, _ in reference.named_parameters()} == {TensorProto.FLOAT}
    assert [i.name for i in model_proto.graph.input if i.name == "loss_scale"] == ["loss_scale"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        eval_expected = lm_loss(reference.eval()(lm_batches(1)[0][0]), lm_batches(1)[0][1])
    torch.testing.assert_close(trainer.eval_step(*lm_batches(1)[0]), eval_expected.float(), rtol=1e-3, atol=0)


def test_overflow_steps_are_skipped_and_the_scale_backs_off_as_gradscaler(fp16_kernels):
    """2^20 overflows the float16 backward: those steps leave weights, moments and counters as they were and halve
    the scale, on the same steps as GradScaler; once it fits, training proceeds as PyTorch's."""
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    scaler = amp.DynamicLossScaler(loss_scale=2.0**20, up_scale_window=1000)
    trainer = _trainer(model, MLP_DESC, ce, optim.AdamConfig(lr=0.01), scaler)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1000)
    before = trainer.state_dict()
    skipped = []
    for batch in mlp_batches(8):
        loss = trainer.train_step(*batch)
        expected = _reference_step(reference, opt, torch_scaler, ce, batch, autocast=True)
        torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0)
        assert scaler.loss_scale == torch_scaler.get_scale()
        skipped.append(not trainer.train_step_info.all_finite)
        if len(skipped) == 1:
            after = trainer.state_dict()
            assert trainer.train_step_info.optimization_step == 0 and trainer.train_step_info.step == 1
            for name, value in before["model"]["full_precision"].items():
                assert torch.equal(after["model"]["full_precision"][name], value), name
            for name, entry in after["optimizer"].items():
                assert entry["Update_Count"].item() == 1 and not entry["Moment_1"].any(), name
    assert skipped[:2] == [True, True] and skipped[-1] is False
    assert trainer.train_step_info.optimization_step == skipped.count(False)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(_weights(trainer)[name], value.detach(), rtol=0, atol=1e-3, msg=name)


def test_float32_math_overflow_is_skipped_too():
    """On the float32 graph only a scale past float32's range overflows: skipped, the scale halved."""
    scaler = amp.DynamicLossScaler(loss_scale=3e38)
    torch.manual_seed(0)
    trainer = _trainer(MLP(), MLP_DESC, ce, optim.AdamConfig(lr=0.01), scaler)
    trainer.train_step(*mlp_batches(1)[0])
    info = trainer.train_step_info
    assert info.all_finite is False and info.optimization_step == 0 and scaler.loss_scale == 1.5e38
    scaler.loss_scale = 1024.0
    trainer.train_step(*mlp_batches(2)[1])
    assert info.all_finite is True and info.optimization_step == 1


def test_accumulation_keeps_the_scale_over_the_cycle_and_equals_gradscaler(fp16_kernels):
    """Two micro-steps per update: the scaled gradients are summed, then checked and unscaled once."""
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    scaler = amp.DynamicLossScaler(loss_scale=2.0**10, up_scale_window=2)
    trainer = _trainer(model, MLP_DESC, ce, optim.SGDConfig(lr=0.1), scaler, batch={"gradient_accumulation_steps": 2})
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    batches = mlp_batches(8)
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        trainer.train_step(*first)
        trainer.train_step(*second)
        opt.zero_grad()
        for x, y in (first, second):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ce(reference(x), y) / 2
            torch_scaler.scale(loss).backward()
        torch_scaler.step(opt)
        torch_scaler.update()
        assert scaler.loss_scale == torch_scaler.get_scale()
    assert scaler.loss_scale == 2.0**12
    for name, value in reference.named_parameters():
        torch.testing.assert_close(_weights(trainer)[name], value.detach(), rtol=0, atol=1e-3, msg=name)


def test_resume_keeps_the_loss_scaler_state_under_the_same_keys(tmp_path):
    def make():
        torch.manual_seed(0)
        scaler = amp.DynamicLossScaler(loss_scale=1024.0, up_scale_window=2)
        return _trainer(MLP(), MLP_DESC, ce, optim.AdamConfig(lr=0.01), scaler)

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
    assert set(a["loss_scaler"]) == set(amp.DynamicLossScaler().state_dict())  # the onnxblock engine's keys
    assert a["loss_scaler"] == b["loss_scaler"] and a["loss_scaler"]["loss_scale"] == 1024.0 * 16
    assert a["trainer_options"]["mixed_precision"] is True
    for name, value in a["model"]["full_precision"].items():
        assert torch.equal(b["model"]["full_precision"][name], value), name


def _half_matmul_model(elem: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=elem),
        helper.make_node("MatMul", ["h", "h"], ["p"]),
        helper.make_node("Cast", ["p"], ["y"], to=TensorProto.FLOAT),
    ]
    value_info = [helper.make_tensor_value_info(n, elem, [2, 2]) for n in ("h", "p")]
    graph = helper.make_graph(nodes, "g", [x], [y], value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_provider_decides_the_precision_and_missing_kernels_are_named(caplog):
    assert autograd_precision(False, "float16", CPU) == Precision()
    assert autograd_precision(True, "float16", CPU) == Precision(None, loss_scale=True)
    assert autograd_precision(True, "bfloat16", CPU) == Precision(None, loss_scale=True)
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        missing = report_fallbacks(_half_matmul_model(TensorProto.FLOAT16), Precision(torch.float16, True), CPU)
    assert missing == ["MatMul"] and "no float16 kernels for ['MatMul']" in caplog.text
    with pytest.raises(ValueError, match=r"no bfloat16 kernels for \['MatMul'\].*use dtype 'float16'"):
        report_fallbacks(_half_matmul_model(TensorProto.BFLOAT16), Precision(torch.bfloat16, True), CPU)


def test_dtype_option_is_checked_and_bfloat16_needs_the_autograd_engine(monkeypatch):
    with pytest.raises(OptionsError, match=r"mixed_precision\.dtype: must be 'float16' or 'bfloat16', got 'half'"):
        _trainer(MLP(), MLP_DESC, ce, optim.SGDConfig(), None, mixed={"dtype": "half"})
    monkeypatch.setattr(assembly, "choose_engine", lambda requested: "onnxblock")
    with pytest.raises(ValueError, match=r"mixed_precision.dtype='bfloat16' needs the autograd engine"):
        _trainer(MLP(), MLP_DESC, ce, optim.SGDConfig(), None, mixed={"dtype": "bfloat16"})


def test_bfloat16_on_cpu_trains_in_float32_with_the_loss_scaled():
    """No bfloat16 MatMul on the CPU provider: the same float32 graph as float16 mixed precision there."""
    torch.manual_seed(0)
    fp16 = _trainer(MLP(), MLP_DESC, ce, optim.AdamConfig(lr=0.01), None)
    torch.manual_seed(0)
    bf16 = _trainer(MLP(), MLP_DESC, ce, optim.AdamConfig(lr=0.01), None, mixed={"dtype": "bfloat16"})
    for batch in mlp_batches(3):
        assert torch.equal(fp16.train_step(*batch), bf16.train_step(*batch))


def test_an_input_named_like_the_loss_scale_is_a_clear_error():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x, loss_scale):
            return self.fc(x) * loss_scale

    desc = {"inputs": [("x", ["b", 4]), ("loss_scale", []), ("y", ["b"])], "outputs": [("loss", [], True)]}
    trainer = _trainer(Scaled(), desc, ce, optim.SGDConfig(), None)
    with pytest.raises(ValueError, match=r"adds the graph input 'loss_scale' \(the loss scale\).*rename it"):
        trainer.train_step(torch.randn(3, 4), torch.tensor(2.0), torch.tensor([0, 1, 0]))
