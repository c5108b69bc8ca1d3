"""``python -m ort_trainer`` names an installed torch, runtime or exporter newer than the newest CI has run
(`ort_trainer._package.versions`), and the declared ranges are the README's policy."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ort_trainer._package.versions import NEWEST_TESTED, newer_than_tested, release
from tests.paths import REPO


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("2.14.1+cpu", (2, 14, 1)), ("1.33.0.dev20261201", (1, 33, 0)), ("0.7.2", (0, 7, 2)), ("3", (3,))],
)
def test_release_reads_the_numeric_part(text, numbers):
    assert release(text) == numbers


def test_a_version_without_a_release_is_named():
    with pytest.raises(ValueError, match=r"version 'main' does not start with a numeric release"):
        release("main")


def test_only_newer_releases_are_named():
    installed = {"torch": "2.13.0+cpu", "onnxruntime": "1.33.0", "onnxscript": NEWEST_TESTED["onnxscript"]}
    newer = newer_than_tested(installed.get)
    assert newer == {"onnxruntime": ("1.33.0", NEWEST_TESTED["onnxruntime"])}
    assert newer_than_tested({"onnxruntime-gpu": "9.0.0"}.get) == {
        "onnxruntime-gpu": ("9.0.0", NEWEST_TESTED["onnxruntime"])
    }


def _fake_distribution(folder: Path, name: str, version: str) -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_cli_warns_about_a_newer_exporter_than_ci_has_run(tmp_path):
    _fake_distribution(tmp_path, "onnxscript", "0.9.0")  # found first on the path: what metadata reports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "ort_trainer"], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    assert "onnxscript 0.9.0" in done.stdout
    assert (
        f"warning: onnxscript 0.9.0 is newer than the newest release CI has run ({NEWEST_TESTED['onnxscript']})"
        in done.stdout
    )


def _setup_module():
    spec = importlib.util.spec_from_file_location("ort_trainer_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module


def test_the_readme_states_the_declared_ranges_and_the_newest_tested_releases():
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Version ranges", 1)[1].split("\n## ", 1)[0]
    setup = _setup_module()
    declared = {setup.STOCK_RUNTIME, setup.TRAINING_ONNX}  # a set: where onnxruntime-training is installed,
    # INSTALL_REQUIRES holds TRAINING_ONNX itself (`runtime_requirements`)
    declared |= {r for r in setup.INSTALL_REQUIRES if re.split(r"[<>=]", r)[0] in ("torch", "onnxscript", "onnx")}
    assert len(declared) == 5, declared
    for requirement in declared:
        assert f"`{requirement}`" in section, f"README's version ranges lack {requirement}"
    for name, version in NEWEST_TESTED.items():
        assert f"{name} {version}" in section, f"README's version ranges lack the newest tested {name} {version}"
