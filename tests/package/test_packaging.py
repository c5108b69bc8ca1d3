"""The built wheel installs exactly one top-level package, ``ort_trainer``, and works beside a user's own
``optim.py`` / ``checkpoint.py`` (the generic names our subpackages had before they moved into the namespace).

The wheel is built from a copy of the working tree and installed with ``--no-deps`` into a fresh virtual
environment; its dependencies (torch, onnxruntime-training, ...) are made visible through a ``.pth`` line
pointing at this environment's site-packages, so no multi-GB download is needed. This environment's own
editable ``ort_trainer`` is not activated there (``.pth`` files in a directory added that way are not run).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.processes  # every test here starts other processes

USER_SCRIPT = """
import optim as user_optim          # the user's own modules, next to the script
import checkpoint as user_checkpoint
assert user_optim.MARK == "user optim" and user_checkpoint.MARK == "user checkpoint"

import torch
import ort_trainer
from ort_trainer import ORTTrainer, amp, checkpoint, optim

assert "site-packages" in ort_trainer.__file__, ort_trainer.__file__
assert checkpoint.__name__ == "ort_trainer.checkpoint" and optim.__name__ == "ort_trainer.optim"
assert amp.__name__ == "ort_trainer.amp"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
desc = {"inputs": [("x", ["batch", 4]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=0.01), loss_fn=torch.nn.functional.cross_entropy)
x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
losses = [float(trainer.train_step(x, y)) for _ in range(5)]
assert losses[-1] < losses[0], losses
trainer.save_checkpoint("ckpt.ortcp", user_dict={"epoch": 1})

fresh = ORTTrainer(model, desc, optim.AdamConfig(lr=0.01), loss_fn=torch.nn.functional.cross_entropy)
assert fresh.load_checkpoint("ckpt.ortcp") == {"epoch": 1}
a, b = trainer.state_dict(), fresh.state_dict()
for name, tensor in a["model"]["full_precision"].items():
    assert torch.equal(tensor, b["model"]["full_precision"][name]), name
print("OK", losses[0], losses[-1])
"""


def _fresh_venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Our dependencies, without our own editable install: a path added by a .pth line is not itself
    # scanned for .pth files, so this environment's editable finder stays inactive there.
    Path(purelib, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("src") / "ort_trainer"
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "out", "__pycache__", "*.ortcp")
    shutil.copytree(REPO, source, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("ort_trainer-*.whl")
    return path


def test_wheel_has_exactly_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level_txt = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        declared = archive.read(top_level_txt).decode().split()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    roots = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert roots == {"ort_trainer"}
    assert declared == ["ort_trainer"]
    for sub in ("checkpoint", "optim", "amp"):
        assert f"ort_trainer/{sub}/__init__.py" in names
    assert any(n == "ort_trainer/checkpoint/format/FORMAT.md" for n in names)
    assert "ort-trainer-ckpt = ort_trainer.checkpoint.__main__:main" in entry_points


def test_installed_wheel_trains_saves_and_loads_beside_user_modules(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    work = tmp_path / "project"
    work.mkdir()
    (work / "optim.py").write_text('MARK = "user optim"\n')
    (work / "checkpoint.py").write_text('MARK = "user checkpoint"\n')
    (work / "train.py").write_text(textwrap.dedent(USER_SCRIPT))
    run = subprocess.run([str(python), "train.py"], cwd=work, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("OK")

    script = tmp_path / "venv" / "bin" / "ort-trainer-ckpt"
    inspected = subprocess.run([str(script), "verify", "ckpt.ortcp"], cwd=work, capture_output=True, text=True)
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    module = subprocess.run(
        [str(python), "-m", "ort_trainer.checkpoint", "inspect", "ckpt.ortcp"], cwd=work, capture_output=True, text=True
    )
    assert module.returncode == 0, module.stdout + module.stderr
    assert "epoch" in module.stdout or "user_dict" in module.stdout
