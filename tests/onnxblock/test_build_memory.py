"""The one-time build holds the weights once (in the trainer's buffers) and says what it is doing.

The export, the graph passes and onnxblock see the model state as shapes only (shell initializers,
then graph inputs); debug graph files and ``extra_postprocess`` still get complete models; every
build phase is logged at INFO with its duration; the eval session waits for the first eval step.
"""

from __future__ import annotations

import copy
import io
import logging
import re

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

import ort_trainer.engine.onnxblock._graphs as onnxblock_graphs
from ort_trainer import ORTTrainer, optim
from ort_trainer.graph._weightless import initializer_data_bytes
from tests.builders import assert_steps_match_torch_sgd
from tests.models import MLP, MLP_DESC, TinyLM, lm_batches, lm_loss, mlp_batches

ce = torch.nn.functional.cross_entropy
LM_DESC = {"inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _lm():
    torch.manual_seed(0)
    return TinyLM(vocab=500, d_model=64, layers=2)  # ~0.2 MB of weights, so data would stand out


def test_onnxblock_gets_a_graph_without_weight_data(monkeypatch):
    seen = []
    real_base = onnxblock_graphs.onnxblock.base

    def recording_base(model, *args, **kwargs):
        seen.append((initializer_data_bytes(model), len(model.graph.initializer), [i.name for i in model.graph.input]))
        return real_base(model, *args, **kwargs)

    monkeypatch.setattr(onnxblock_graphs.onnxblock, "base", recording_base)
    model = _lm()
    trainer = ORTTrainer(model, LM_DESC, optim.AdamConfig(lr=1e-3), loss_fn=lm_loss)
    trainer.train_step(*lm_batches(1, vocab=500)[0])
    assert len(seen) == 1
    data, _, inputs = seen[0]
    assert data < 0.01 * _weight_bytes(model), f"onnxblock got {data} bytes of initializer data"
    assert "embed.weight" in inputs and "head.weight" in inputs  # the state arrives as graph inputs


def test_model_state_keeps_no_copy_of_the_float_weights():
    trainer = ORTTrainer(MLP(), MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    initial = trainer.trainer_state.store.state.initial
    assert initial and all(t.device.type == "meta" for t in initial.values() if t.is_floating_point())
    # state_dict() still gives real tensors of the module's dtypes and values
    state = trainer.state_dict(pytorch_format=True)
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in state.values())


def test_the_module_is_untouched_and_the_trained_weights_match_torch():
    model = _lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = _lm()
    legacy = {"utils": {"share_module_parameters": False}}  # the legacy behaviour: the module is left as it was
    trainer = ORTTrainer(model, LM_DESC, optim.SGDConfig(lr=0.1), loss_fn=lm_loss, options=legacy)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for tokens, label in lm_batches(2, vocab=500):
        got = trainer.train_step(tokens, label)
        opt.zero_grad()
        expected = lm_loss(reference(tokens), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)
    for name, value in trainer.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(value, reference.state_dict()[name], atol=1e-5, rtol=1e-5)


def test_build_phases_are_logged_with_durations(caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    trainer = ORTTrainer(MLP(), MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    x, label = mlp_batches(1)[0]
    trainer.train_step(x, label)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ort_trainer")]
    for phase in ("export", "forward graph passes", "gradient graph", "training session"):
        assert any(re.fullmatch(rf"ORTTrainer build phase '{phase}' took \d+\.\d\d s", m) for m in messages), messages
    assert any(re.match(r"ORTTrainer build done in \d+\.\d\d s \(export \d+\.\d\d s, ", m) for m in messages)
    assert not any("eval session" in m for m in messages)  # not built until an eval step needs it
    caplog.clear()
    trainer.train_step(x, label)
    assert not [r for r in caplog.records if r.name.startswith("ort_trainer")]  # built once
    trainer.eval_step(x, label)
    assert any(re.fullmatch(r"ORTTrainer eval session phase 'eval session' took \d+\.\d\d s", r.getMessage())
               for r in caplog.records)  # fmt: skip


def test_eval_session_is_created_on_the_first_eval_step_and_matches_torch():
    torch.manual_seed(1)
    model = MLP()
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.0), loss_fn=ce)
    x, label = mlp_batches(1)[0]
    trainer.train_step(x, label)
    assert trainer.trainer_state.engine.session._eval is None
    model.eval()
    with torch.no_grad():
        expected = ce(model(x), label)
    torch.testing.assert_close(trainer.eval_step(x, label), expected, atol=1e-6, rtol=1e-5)
    assert trainer.trainer_state.engine.session._eval is not None


def test_debug_graph_files_and_extra_postprocess_see_the_weights(tmp_path):
    seen = {}

    def postprocess(model):
        seen.update({i.name: numpy_helper.to_array(i).copy() for i in model.graph.initializer})
        return model

    path = tmp_path / "forward.onnx"
    options = {
        "debug": {"graph_save_paths": {"model_after_graph_transforms_path": str(path)}},
        "_internal_use": {"extra_postprocess": postprocess},
    }
    model = MLP()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=options)
    x, label = mlp_batches(1)[0]
    trainer.train_step(x, label)
    for name, value in initial.items():  # the values at construction (no step had run yet)
        np.testing.assert_array_equal(seen[name], value.numpy())
    saved = onnx.load(str(path))
    saved_values = {i.name: numpy_helper.to_array(i) for i in saved.graph.initializer}
    for name, value in initial.items():
        np.testing.assert_array_equal(saved_values[name], value.numpy())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # a complete, runnable model
    (loss,) = [o for o in session.run(["loss"], {"x": x.numpy(), "label": label.numpy()})]
    assert np.isfinite(loss).all()


def test_an_onnx_model_is_built_without_copying_its_weights(monkeypatch):
    seen = []
    real_base = onnxblock_graphs.onnxblock.base

    def recording_base(model, *args, **kwargs):
        seen.append(initializer_data_bytes(model))
        return real_base(model, *args, **kwargs)

    monkeypatch.setattr(onnxblock_graphs.onnxblock, "base", recording_base)
    torch.manual_seed(2)
    model = MLP()
    x, label = mlp_batches(1)[0]
    buffer = io.BytesIO()
    torch.onnx.export(
        _WithLoss(copy.deepcopy(model)), (x, label), buffer, input_names=["x", "label"], output_names=["loss"],
        dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}}, opset_version=17, do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING, dynamo=False,
    )  # fmt: skip
    onnx_model = onnx.load_from_string(buffer.getvalue())
    before = onnx_model.SerializeToString()
    from_onnx = ORTTrainer(onnx_model, MLP_DESC, optim.SGDConfig(lr=0.1))
    from_torch = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    for batch in mlp_batches(2):
        torch.testing.assert_close(from_onnx.train_step(*batch), from_torch.train_step(*batch))
    assert seen[0] < 0.01 * _weight_bytes(model)  # the ONNX model's weights were not copied into the build
    assert onnx_model.SerializeToString() == before  # the user's model is left as it was


class _WithLoss(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, label):
        return ce(self.m(x), label)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_progress_bar_names_the_running_phase(monkeypatch):
    from ort_trainer.engine._progress import BuildProgress

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    progress = BuildProgress(2, "ORTTrainer build")
    with progress.phase("export"):
        pass
    with progress.phase("gradient graph"):
        pass
    total = progress.close()
    shown = terminal.getvalue()
    assert "ORTTrainer build: export" in shown and "ORTTrainer build: gradient graph" in shown
    assert "[1/2 phases" in shown and set(progress.durations) == {"export", "gradient graph"}
    assert total >= sum(progress.durations.values())


_KEPT: list[bool] = []  # module level: the trainer traces a deep copy of the module


class _RecordsSaved(torch.nn.Module):
    """An MLP that notes whether the activation its last layer saves for a backward was kept (at the export's trace)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x):
        out = self.mlp(x)
        _KEPT.append(_keeps_its_input(out))
        return out


def _keeps_its_input(out: torch.Tensor) -> bool:
    if out.grad_fn is None:  # autograd did not record at all
        return False
    try:
        return out.grad_fn._saved_mat1 is not None  # Linear's input, saved for the weight's gradient
    except RuntimeError:  # dropped by the export's saved-tensor hook
        return False


def test_the_export_trace_keeps_no_activations_for_a_backward_and_still_trains_like_torch():
    """The trace records autograd (to see where torch records no gradient) but keeps none of its activations."""
    torch.manual_seed(7)
    _KEPT.clear()
    model = _RecordsSaved()
    reference = copy.deepcopy(model.mlp)
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    assert_steps_match_torch_sgd(trainer, reference, mlp_batches(2))
    assert _KEPT and not any(_KEPT)
    assert _keeps_its_input(model(torch.randn(2, 20)))  # outside the export: torch keeps it, as always
