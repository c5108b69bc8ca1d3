"""Exactly one ONNX Runtime package: what `setup.py` requires where, and the refusal of two installed over
each other."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ort_trainer._package.runtimes import installed_runtimes, runtime_conflict
from ort_trainer.engine import _sources
from tests.paths import REPO


def _setup_module():
    spec = importlib.util.spec_from_file_location("ort_trainer_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module


def test_setup_requires_the_stock_runtime_unless_another_runtime_is_installed():
    setup = _setup_module()
    assert setup.runtime_requirements({"numpy", "torch"}) == ["onnxruntime>=1.31,<2"]
    assert setup.runtime_requirements({"onnxruntime-training", "torch"}) == ["onnx>=1.17,<1.18"]
    assert setup.runtime_requirements({"onnxruntime-gpu"}) == []


def _fake_distribution(folder: Path, name: str, version: str) -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_two_runtimes_installed_over_each_other_are_named_with_the_repair(tmp_path):
    _fake_distribution(tmp_path, "onnxruntime", "1.31.1")
    assert installed_runtimes([str(tmp_path)]) == {"onnxruntime": "1.31.1"}
    assert runtime_conflict([str(tmp_path)]) is None
    _fake_distribution(tmp_path, "onnxruntime-training", "1.19.2")
    message = runtime_conflict([str(tmp_path)])
    assert "onnxruntime 1.31.1, onnxruntime-training 1.19.2" in message
    assert "pip uninstall -y onnxruntime onnxruntime-training" in message


def test_the_trainer_refuses_to_start_on_a_mixed_runtime(monkeypatch, tmp_path):
    _fake_distribution(tmp_path, "onnxruntime", "1.31.1")
    _fake_distribution(tmp_path, "onnxruntime-training", "1.19.2")
    monkeypatch.setattr(_sources, "runtime_conflict", lambda: runtime_conflict([str(tmp_path)]))
    with pytest.raises(ImportError, match=r"several ONNX Runtime packages are installed over each other"):
        _sources.choose_engine("auto")


def test_this_environment_has_exactly_one_runtime():
    assert len(installed_runtimes()) == 1, installed_runtimes()
