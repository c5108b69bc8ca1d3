"""A training artifact run in stock onnxruntime (the reference driver) trains as ``ORTTrainer.train_step``.

20 steps from the same state, batches of two sizes through the one graph, every update rule the artifact writes:
losses and weights within 1e-6. The artifact's graphs are plain ONNX: default domain only, opset 18, IR <= 10,
the batch dims symbolic.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ort_trainer import optim
from tests.export.artifacts import compare_runs, gpt2_case, mlp_case, optimizers

TOLERANCE = 1e-6


def _plain_onnx(path) -> onnx.ModelProto:
    model = onnx.load(path)
    assert model.ir_version <= 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    assert {n.domain for n in model.graph.node} == {""}
    assert not model.graph.initializer or max(np.prod(i.dims) for i in model.graph.initializer) < 1000  # no weights
    return model


@pytest.mark.parametrize("name", sorted(optimizers()))
def test_mlp_artifact_trains_as_the_trainer_for_20_steps_at_two_batch_sizes(tmp_path, name):
    runs = compare_runs(mlp_case(), optimizers()[name], tmp_path / "mlp")
    np.testing.assert_allclose(runs.artifact_losses, runs.trainer_losses, rtol=0, atol=TOLERANCE)
    assert max(runs.weight_differences().values()) <= TOLERANCE
    assert runs.runner.step == 20
    train = _plain_onnx(tmp_path / "mlp" / "train_step.onnx")
    _plain_onnx(tmp_path / "mlp" / "eval_step.onnx")
    x = next(i for i in train.graph.input if i.name == "x")
    assert [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim] == ["batch", 20]
    # the update is not a no-op
    start = mlp_case().model().fc1.weight.detach().numpy()
    assert np.abs(runs.runner.state["fc1.weight"] - start).max() > 1e-3


def test_a_learning_rate_schedule_is_fed_step_by_step(tmp_path):
    def config():
        return optim.AdamConfig(lr=5e-2, weight_decay=0.01)

    options = {"lr_scheduler": optim.lr_scheduler.LinearWarmupLRScheduler(total_steps=20, warmup=0.3)}
    runs = compare_runs(mlp_case(), config, tmp_path / "mlp", options=options)
    np.testing.assert_allclose(runs.artifact_losses, runs.trainer_losses, rtol=0, atol=TOLERANCE)
    assert max(runs.weight_differences().values()) <= TOLERANCE


def _key_bias_slices(runs) -> dict[str, slice]:
    """GPT-2's attention key biases (the middle third of each ``c_attn.bias``): softmax does not change when a row
    of scores shifts, so their gradient is exactly 0 in exact arithmetic and float noise (~1e-12) in either run.
    Adam divides that noise by ``sqrt(v) + eps`` into steps of up to ~lr * 1e-3, and the noise itself changes with
    any last-bit difference of the weights: those entries are compared with a bound of their own."""
    d = 32
    return {n: slice(d, 2 * d) for n in runs.weight_differences() if n.endswith("attn.c_attn.bias")}


def _assert_gpt2_runs_agree(runs, lr: float) -> None:
    np.testing.assert_allclose(runs.artifact_losses, runs.trainer_losses, rtol=0, atol=TOLERANCE)
    keys = _key_bias_slices(runs)
    assert len(keys) == 2
    weights = runs.trainer.state_dict()["model"]["full_precision"]
    for name, value in weights.items():
        diff = np.abs(runs.runner.state[name] - value.numpy())
        if name in keys:
            assert diff[keys[name]].max() <= lr * 20 * 1e-2, name
            diff[keys[name]] = 0
        assert diff.max() <= TOLERANCE, (name, float(diff.max()))


def test_tiny_gpt2_artifact_trains_as_the_trainer_with_adamw(tmp_path):
    runs = compare_runs(gpt2_case(), optimizers()["adamw"], tmp_path / "gpt2")
    _assert_gpt2_runs_agree(runs, lr=1e-2)
    train = _plain_onnx(tmp_path / "gpt2" / "train_step.onnx")
    ids = next(i for i in train.graph.input if i.name == "input_ids")
    assert [d.dim_param for d in ids.type.tensor_type.shape.dim] == ["batch", "seq"]


@pytest.mark.parametrize("name", ["adam_mode1", "adam_no_bias_correction", "lamb", "sgd"])
def test_tiny_gpt2_artifact_trains_as_the_trainer_with_every_optimizer(tmp_path, name):
    runs = compare_runs(gpt2_case(), optimizers(lr=2e-3)[name], tmp_path / "gpt2")
    _assert_gpt2_runs_agree(runs, lr=optimizers(lr=2e-3)[name]().lr)


def test_dropout_draws_are_graph_inputs_and_the_trainer_s_masks_give_its_numbers(tmp_path):
    runs = compare_runs(gpt2_case(dropout=0.1), optimizers()["adamw"], tmp_path / "gpt2", steps=6, same_draws=True)
    random = runs.runner.manifest["random"]
    assert random and all(r["kind"] == "uniform" and r["dtype"] == "float32" for r in random)
    shapes = {tuple(r["shape"]) for r in random}
    assert ("batch", "seq", 32) in shapes  # the residual/embedding dropouts, sized by the batch
    np.testing.assert_allclose(runs.artifact_losses, runs.trainer_losses, rtol=0, atol=TOLERANCE)
    # the masks matter: fresh draws from the driver's own generator give other losses
    fresh = compare_runs(gpt2_case(dropout=0.1), optimizers()["adamw"], tmp_path / "fresh", steps=2)
    assert fresh.artifact_losses[1] != pytest.approx(fresh.trainer_losses[1], abs=1e-4)
