"""Bad artifacts and bad calls are refused by name: the file, the key, what was expected.

A missing or corrupt manifest or state file, a state tensor of the wrong shape or dtype, a header that claims more
bytes than the file has (checked before anything is read), an unknown optimizer, a batch of the wrong dtype or
shape. Nothing in an artifact is executed: the manifest is JSON, the state safetensors.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_trainer import ArtifactRunner, export_training, load_training_state, optim
from ort_trainer.export import ArtifactError
from ort_trainer.export._state_file import read_state, write_state
from tests.export.artifacts import feeds, mlp_case, optimizers


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    case = mlp_case()
    folder = tmp_path_factory.mktemp("artifact") / "mlp"
    export_training(case.model(), folder, inputs=case.batches(1)[0], model_desc=case.desc,
                    optimizer=optimizers()["adamw"](), loss_fn=case.loss_fn)  # fmt: skip
    return folder


@pytest.fixture
def copy(artifact, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    return target


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder, manifest) -> None:
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_missing_manifest_names_the_folder(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"manifest\.json: no manifest"):
        ArtifactRunner(copy)
    with pytest.raises(ArtifactError, match="no manifest"):
        load_training_state(copy)


def test_a_manifest_that_is_not_json_is_refused(copy):
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"manifest\.json: not JSON"):
        ArtifactRunner(copy)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("train"), "train: missing"),
        (lambda m: m.update(version=2), "version: this ort_trainer reads version 1, got 2"),
        (lambda m: m.update(format="something.else"), "format: expected 'ort_trainer.training_artifact'"),
        (lambda m: m["files"].update(state="../../etc/passwd"), r"files\.state: expected a file name inside"),
        (lambda m: m["state"][0].update(dtype="complex64"), r"state\[0\]\.dtype: expected one of"),
        (lambda m: m["state"][0].update(role="weights"), r"state\[0\]\.role: expected one of"),
        (lambda m: m["inputs"][0].update(shape=["batch+1", 20]), r"inputs\[0\]\.shape: 'batch\+1' is not a size"),
        (lambda m: m["train"]["updated"].update(nothing="x"), r"train\.updated: names \['nothing'\]"),
        (lambda m: m["train"].update(scalars={"lr": "float16"}), r"train\.scalars: expected"),
        (lambda m: m.update(step=-1), "step: expected an integer >= 0"),
    ],
)
def test_a_manifest_key_that_is_missing_or_wrong_is_named(copy, edit, message):
    manifest = _manifest(copy)
    edit(manifest)
    _write_manifest(copy, manifest)
    with pytest.raises(ArtifactError, match=message):
        ArtifactRunner(copy)


def test_an_unknown_optimizer_in_the_manifest_is_refused_when_loading_the_state(copy):
    manifest = _manifest(copy)
    manifest["optimizer"]["config"] = "AdagradOptimizer"
    _write_manifest(copy, manifest)
    with pytest.raises(ArtifactError, match="optimizer.config 'AdagradOptimizer' is not one of"):
        load_training_state(copy)


def test_an_unknown_optimizer_given_to_the_exporter_is_refused():
    case = mlp_case()
    with pytest.raises(TypeError, match="optim_config must be an optim.AdamConfig"):
        export_training(case.model(), "unused", inputs=case.batches(1)[0], model_desc=case.desc,
                        optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1), loss_fn=case.loss_fn)  # fmt: skip
    with pytest.raises(ValueError, match="optimizer must be one of"):
        load_training_state_of_a_file_with(optimizer="Adagrad")


def load_training_state_of_a_file_with(optimizer):
    path = Path(tempfile.mkdtemp()) / "state.safetensors"
    write_state(path, {"w": np.zeros(2, np.float32), "optimizer.w.exp_avg": np.zeros(2, np.float32)}, 0)
    return load_training_state(path, optimizer=optimizer)


def test_a_truncated_state_file_is_refused_before_reading(copy):
    path = copy / "state.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ArtifactError, match=r"state\.safetensors: tensor .* do not hold .* \(truncated or corrupt\)"):
        ArtifactRunner(copy)


def test_a_header_that_claims_more_than_the_file_is_refused_without_allocating(copy):
    path = copy / "state.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 60) + data[8:])
    with pytest.raises(ArtifactError, match=r"header claims 1,152,921,504,606,846,976 bytes"):
        load_training_state(copy)
    path.write_bytes(b"1234")
    with pytest.raises(ArtifactError, match="too short for a safetensors file"):
        load_training_state(copy)


def test_a_state_file_of_another_format_is_refused(copy, tmp_path):
    import safetensors.numpy

    other = tmp_path / "other.safetensors"
    safetensors.numpy.save_file({"fc1.weight": np.zeros((16, 20), np.float32)}, str(other), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match=r"__metadata__ .* is not a training artifact's"):
        load_training_state(copy, state=other)


def test_a_state_tensor_of_the_wrong_shape_or_dtype_is_named(copy, tmp_path):
    tensors, step = read_state(copy / "state.safetensors")
    wrong_shape = dict(tensors, **{"fc1.weight": np.zeros((16, 21), np.float32)})
    write_state(tmp_path / "shape.safetensors", wrong_shape, step)
    with pytest.raises(
        ArtifactError, match=r"'fc1.weight' is float32 \[16, 21\], the manifest expects float32 \[16, 20\]"
    ):
        ArtifactRunner(copy, state=tmp_path / "shape.safetensors")
    wrong_dtype = dict(tensors, **{"fc2.bias": np.zeros(4, np.float64)})
    write_state(tmp_path / "dtype.safetensors", wrong_dtype, step)
    with pytest.raises(ArtifactError, match=r"'fc2.bias' is float64 \[4\], the manifest expects float32 \[4\]"):
        load_training_state(copy, state=tmp_path / "dtype.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "fc2.bias"}
    write_state(tmp_path / "missing.safetensors", missing, step)
    with pytest.raises(ArtifactError, match=r"missing \['fc2.bias'\]"):
        ArtifactRunner(copy, state=tmp_path / "missing.safetensors")


def test_a_missing_graph_file_is_named(copy):
    (copy / "train_step.onnx").unlink()
    with pytest.raises(ArtifactError, match=r"train_step\.onnx: the graph file the manifest names is missing"):
        ArtifactRunner(copy)


def test_a_batch_of_the_wrong_dtype_or_shape_is_named(artifact):
    runner = ArtifactRunner(artifact)
    x, y = mlp_case().batches(1)[0]
    with pytest.raises(TypeError, match="input 'x': expected a numpy array of float32, got float64"):
        runner.train_step({"x": x.double().numpy(), "label": y.numpy()}, 0.01)
    with pytest.raises(ValueError, match=r"input 'x': expected shape \['batch', 20\], got \[8, 19\]"):
        runner.train_step({"x": x[:, :19].numpy(), "label": y.numpy()}, 0.01)
    with pytest.raises(ValueError, match="input 'label': dim 'batch' is 5, another input has it 8"):
        runner.train_step({"x": x.numpy(), "label": y[:5].numpy()}, 0.01)
    with pytest.raises(KeyError, match="the batch lacks the input 'label'"):
        runner.train_step({"x": x.numpy()}, 0.01)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        runner.train_step(feeds(runner, (x, y)), float("nan"))
    assert runner.step == 0  # nothing ran


def test_export_refuses_what_one_graph_cannot_express(tmp_path):
    case = mlp_case()
    options = {"batch": {"gradient_accumulation_steps": 2}}
    with pytest.raises(ValueError, match="gradient_accumulation_steps > 1"):
        export_training(case.model(), tmp_path / "a", inputs=case.batches(1)[0], model_desc=case.desc,
                        optimizer=optim.SGDConfig(lr=0.1), loss_fn=case.loss_fn, options=options)  # fmt: skip
    with pytest.raises(ValueError, match="2 inputs given|1 inputs given"):
        export_training(case.model(), tmp_path / "b", inputs=case.batches(1)[0][:1], model_desc=case.desc,
                        optimizer=optim.SGDConfig(lr=0.1), loss_fn=case.loss_fn)  # fmt: skip
    (tmp_path / "c").mkdir()
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_training(case.model(), tmp_path / "c", inputs=case.batches(1)[0], model_desc=case.desc,
                        optimizer=optim.SGDConfig(lr=0.1), loss_fn=case.loss_fn)  # fmt: skip


def test_a_random_op_the_manifest_cannot_size_is_refused_by_name(tmp_path):
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(20, 4)

        def forward(self, x):  # a draw whose size is batch + 1: no product of dims
            noise = torch.rand(torch.cat([x, x[:1]]).shape[0], 4)
            return self.fc(x) + noise[: x.shape[0]]

    case = mlp_case()
    with pytest.raises(ValueError, match=r"cannot keep the dims \['batch'\] symbolic .*random draw random.0"):
        export_training(Noisy(), tmp_path / "noisy", inputs=case.batches(1)[0], model_desc=case.desc,
                        optimizer=optim.SGDConfig(lr=0.1), loss_fn=case.loss_fn)  # fmt: skip
