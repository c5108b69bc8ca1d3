"""The built wheel installs exactly one top-level package, ``ort_trainer``, and works beside a user's own
``optim.py`` / ``checkpoint.py`` (the generic names our subpackages had before they moved into the namespace).

The wheel is built from a copy of the working tree and installed with ``--no-deps`` into a fresh virtual
environment; its dependencies (torch, onnxruntime-training, ...) are made visible through a ``.pth`` line
pointing at this environment's site-packages, so no multi-GB download is needed. This environment's own
editable ``ort_trainer`` is not activated there (``.pth`` files in a directory added that way are not run).
"""

from __future__ import annotations

import email.message
import email.parser
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ort_trainer._package.runtimes import installed_runtimes
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

# what a copy of the working tree leaves out: every venv (`make test-latest`'s holds a multi-GB CUDA torch: three
# copies filled a 64 GB disk), npm's packages, build outputs and caches
_COPY_IGNORE = shutil.ignore_patterns(
    ".venv*", ".git", "node_modules", "build", "dist", "*.egg-info", "out", "__pycache__", "*.ortcp"
)


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
    ignore = _COPY_IGNORE
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


# ---- the gates a new user passes first: metadata, extras, version, source-tree imports -----------------------
def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_wheel_metadata_declares_ranges_extras_license_and_types(wheel):
    meta = _metadata(wheel)
    requirements = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    runtime = {r.name: r.specifier for r in requirements if r.marker is None}
    assert runtime["torch"].contains("2.13.0") and runtime["torch"].contains("2.14.1")
    assert not runtime["torch"].contains("2.15.0") and not runtime["torch"].contains("2.12.0")
    training = "onnxruntime-training" in installed_runtimes()  # built here: setup.py looked at this environment
    if training:  # the runtime already installed is kept: no second one over it
        assert "onnxruntime" not in runtime and "onnxruntime-training" not in runtime, runtime
    else:
        assert runtime["onnxruntime"].contains("1.31.1") and not runtime["onnxruntime"].contains("1.19.2")
    assert runtime["onnx"].contains("1.17.0") and runtime["onnx"].contains("1.23.2")
    assert runtime["onnxscript"].contains("0.7.2")
    assert runtime["safetensors"].contains("0.8.0")  # training artifacts (export_training) on a plain install
    for name, spec in runtime.items():  # ranges, not pins
        assert ">=" in str(spec) and "==" not in str(spec), (name, spec)
    lock = REPO / ("requirements-onnxblock.txt" if training else "requirements.txt")
    pinned = dict(
        line.split("==") for line in lock.read_text().splitlines() if "==" in line
    )  # the lock file CI installs must satisfy every range
    for name, spec in runtime.items():
        assert spec.contains(pinned[name].strip(), prereleases=True), (name, spec, pinned[name])
    extras = {}
    for r in requirements:
        if r.marker is not None:
            extra = str(r.marker).split("==")[1].strip().strip("\"'")
            extras.setdefault(extra, set()).add(r.name)
    assert {"safetensors"} <= extras["safetensors"] and {"fsspec", "s3fs"} <= extras["s3"]
    assert {"pytest", "ruff", "safetensors", "transformers", "moto"} <= extras["dev"], extras["dev"]
    assert "matplotlib" in extras["samples"]
    # `License:` is the field `pip show` prints on the pip Python 3.11 ships (23.x/24.0); setuptools writes either it
    # or PEP 639's License-Expression, never both, so the package declares `license="MIT"` (an SPDX id either way)
    assert meta["License"] == "MIT" and meta["License-File"] == "LICENSE"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "ort_trainer/py.typed" in names and "ort_trainer/__main__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A distribution with metadata only (pip resolves against it without downloading the real one)."""
    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{info}/RECORD"]))
    return path


def test_the_wheel_installs_beside_torch_2_14(wheel, tmp_path):
    """pip resolves ort_trainer together with torch 2.14 (the exact pin of 0.1.0 made that impossible)."""
    _fake_wheel(tmp_path, "torch", "2.14.0")
    resolved = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(tmp_path)]
        + [str(wheel), "torch==2.14.0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    assert "torch-2.14.0" in resolved.stdout, resolved.stdout


def test_installed_wheel_has_version_info_command_and_typed_marker(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    version = _metadata(wheel)["Version"]
    script = tmp_path / "venv" / "bin" / "ort-trainer-ckpt"
    shown = subprocess.run([str(script), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.strip() == f"ort-trainer-ckpt (ort_trainer) {version}", shown
    info = subprocess.run([str(python), "-m", "ort_trainer"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert info.stdout.startswith(f"ort_trainer {version} (") and "site-packages" in info.stdout.splitlines()[0]
    runtimes = [f"{name} {version}" for name, version in installed_runtimes().items()]
    expected = ("torch 2.", *runtimes, "onnx 1.17.0", "onnxscript 0.7.2", "CPUExecutionProvider", "threads: ")
    expected += ("engine (utils.engine='auto'): ",)
    for line in expected:
        assert line in info.stdout, info.stdout
    typed = subprocess.run(
        [
            str(python),
            "-c",
            "import ort_trainer, pathlib; print(pathlib.Path(ort_trainer.__file__).with_name('py.typed').is_file())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typed.stdout.strip() == "True", typed


_FROM_ROOT = """
import importlib.util, sys
import ort_trainer
from ort_trainer import amp, checkpoint, optim
from ort_trainer.checkpoint.format import FORMAT_VERSION
for name in ("samples", "tests", "benchmarks", "docs"):
    assert importlib.util.find_spec("ort_trainer." + name) is None, name
if sys.argv[1:] == ["trainer"]:
    from ort_trainer import ORTTrainer
print(ort_trainer.__file__, checkpoint.__file__, optim.__file__, amp.__file__, FORMAT_VERSION)
"""


def _source_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "clone"
    ignore = _COPY_IGNORE
    shutil.copytree(REPO, copy, ignore=ignore)
    return copy


@pytest.mark.parametrize("install", ["wheel", "nothing", "editable"])
def test_import_from_the_repository_root(wheel, tmp_path, install):
    """`python -c "import ort_trainer"` in a clone's root: the clone's code, its three mapped subpackages found."""
    python = _fresh_venv(tmp_path / "venv")
    clone = _source_copy(tmp_path)
    if install != "nothing":
        target = [str(wheel)] if install == "wheel" else ["--no-build-isolation", "-e", str(clone)]
        installed = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", *target],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert installed.returncode == 0, installed.stdout + installed.stderr
    extra = ["trainer"] if install == "wheel" else []  # the whole package once (torch, ONNX Runtime)
    run = subprocess.run(
        [str(python), "-c", _FROM_ROOT, *extra], cwd=clone, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    package, sub_checkpoint, sub_optim, sub_amp, _ = run.stdout.split()
    assert package == str(clone / "ort_trainer" / "__init__.py")
    assert (sub_checkpoint, sub_optim, sub_amp) == tuple(
        str(clone / s / "__init__.py") for s in ("checkpoint", "optim", "amp")
    )
