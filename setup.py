"""ort_trainer: train PyTorch models on ONNX Runtime, with checkpoints you can trust.

One top-level import package, ``ort_trainer``. Its subpackages ``ort_trainer.checkpoint``,
``ort_trainer.optim`` and ``ort_trainer.amp`` keep their folders at the top of the repository
(``checkpoint/``, ``optim/``, ``amp/``) and are mapped into the namespace by ``package_dir``.
"""

import re
import sysconfig
from importlib import metadata
from pathlib import Path

from setuptools import find_packages, setup

_SUBPACKAGES = ("checkpoint", "optim", "amp")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages = find_packages(include=["ort_trainer", "ort_trainer.*"])  # ort_trainer and its own subpackages
    package_dir = {"ort_trainer": "ort_trainer"}
    for sub in _SUBPACKAGES:
        package_dir[f"ort_trainer.{sub}"] = sub
        packages.append(f"ort_trainer.{sub}")
        packages += [f"ort_trainer.{sub}.{p}" for p in find_packages(where=sub)]
    return sorted(set(packages)), package_dir


def _version() -> str:
    """The one place the version is written: ``__version__`` in ort_trainer/__init__.py."""
    text = Path(__file__).with_name("ort_trainer").joinpath("__init__.py").read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE).group(1)


PACKAGES, PACKAGE_DIR = _packages()

# The ONNX Runtime a plain `pip install .` brings: the stock package (every Python and platform it ships for;
# the autograd engine). Where onnxruntime-training (or a GPU build) is already installed in the target
# environment, no second runtime is required: both provide the `onnxruntime` module and must never be
# installed over each other (docs/engines.md; the trainer refuses to start when they are).
# 1.31 is the oldest release CI runs (the lock, requirements.txt); `make test-latest` runs the newest the range admits.
# Releases before 1.31 are not run anywhere, so they are not admitted (1.20-1.30 were, untested, until 2026-11-29).
STOCK_RUNTIME = "onnxruntime>=1.31,<2"
# onnxruntime-training 1.19.2 reads the models onnx 1.17 writes and rejects newer IR versions; its wheel does not
# say so, so where it is installed we do (a training venv would otherwise get the newest onnx beside it)
TRAINING_ONNX = "onnx>=1.17,<1.18"
_TRAINING_RUNTIMES = ("onnxruntime-training", "onnxruntime-training-cpu")
_OTHER_RUNTIMES = (*_TRAINING_RUNTIMES, "onnxruntime-gpu")


def runtime_requirements(installed: set[str]) -> list[str]:
    """The runtime to require, given the distribution names already installed in the target environment."""
    if installed & set(_TRAINING_RUNTIMES):
        return [TRAINING_ONNX]
    return [] if installed & set(_OTHER_RUNTIMES) else [STOCK_RUNTIME]


def _target_distributions() -> set[str]:
    """Distributions installed in the environment being installed into (pip builds in an isolated overlay,
    but with the target's interpreter: its purelib/platlib are the target's site-packages)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions(path=paths)}


# Ranges, not pins: the lower bound is the version CI installs and tests (requirements.txt, the lock file of
# the test environment); the upper bound is the next major (minor for torch) release nobody has tried yet.
INSTALL_REQUIRES = [
    # torch 2.13 is what CI tests; 2.14 resolves and imports beside us (tests/package/test_packaging.py).
    "torch>=2.13,<2.15",
    *runtime_requirements(_target_distributions()),
    # the autograd engine's exporter (torch.onnx.export(dynamo=True) translates aten ops with onnxscript)
    "onnxscript>=0.7.2,<0.8",
    # 1.17 is what onnxruntime-training 1.19.2 reads (newer onnx writes IR 11+, which it rejects); the autograd
    # engine works with 1.17 up to the current release (its exporter writes IR 10, opset 20).
    "onnx>=1.17,<2",
    "numpy>=2.2.6,<3",
    "h5py>=3.16,<4",
    "tqdm>=4.70.1,<5",
    "crc32c>=2.9.post0,<3",
    # training artifacts (ort_trainer.export_training) keep their state in safetensors, which every runtime reads
    "safetensors>=0.8.0,<1",
]

EXTRAS_REQUIRE = {
    # checkpoints at fsspec URLs (memory://, file://, ...); s3:// needs s3fs too
    "fsspec": ["fsspec>=2026.9.0"],
    "s3": ["fsspec>=2026.9.0", "s3fs>=2026.9.0"],
    # kept for installs that name it: safetensors is a dependency of every install now (training artifacts)
    "safetensors": ["safetensors>=0.8.0,<1"],
    # the scripts in samples/ (loss curves)
    "samples": ["matplotlib>=3.11.2"],
    # ort_trainer.hf.Trainer: transformers.Trainer on ONNX Runtime (docs/hf.md)
    "hf": ["transformers>=5.23,<6", "accelerate>=1.1"],
    # everything `make test` / `make lint` need on top of the above (versions locked by requirements.txt)
    "dev": [
        "pytest>=9.2",
        "pytest-xdist>=3.8",
        "ruff>=0.17.6",
        "safetensors>=0.8.0,<1",
        "matplotlib>=3.11.2",
        "google-crc32c>=1.9.0",
        "transformers>=5.23,<6",
        "accelerate>=1.1",
        "fsspec>=2026.9.0",
        "s3fs>=2026.9.0",
        "moto[server]>=5.2.5",
        "protobuf>=7.36.2",
    ],
}

if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it for its functions
    setup(
        name="ort_trainer",
        version=_version(),
        description="Train PyTorch or ONNX models on ONNX Runtime; HDF5 checkpoints with ZeRO/Megatron aggregation.",
        long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
        long_description_content_type="text/markdown",
        # MIT: compatible with ONNX Runtime (MIT) and PyTorch (BSD-3-Clause). `license=` writes the `License:` field
        # that `pip show` prints on the pip Python 3.11 ships; PEP 639's `license_expression` would replace it with
        # `License-Expression`, which that pip does not show (setuptools writes one or the other, not both)
        license="MIT",
        license_files=["LICENSE"],
        classifiers=[
            "Programming Language :: Python :: 3",
            "Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12",
            "Programming Language :: Python :: 3.13",
            "Programming Language :: Python :: 3.14",
            "Operating System :: OS Independent",
            "Topic :: Scientific/Engineering :: Artificial Intelligence",
            "Typing :: Typed",
        ],
        packages=PACKAGES,
        package_dir=PACKAGE_DIR,
        package_data={"ort_trainer": ["py.typed"], "ort_trainer.checkpoint.format": ["FORMAT.md"]},
        python_requires=">=3.11",
        install_requires=INSTALL_REQUIRES,
        extras_require=EXTRAS_REQUIRE,
        entry_points={
            "console_scripts": ["ort-trainer-ckpt=ort_trainer.checkpoint.__main__:main"],
            # torch.compile(model, backend="ort_trainer") finds the backend without an import (docs/ortmodule.md)
            "torch_dynamo_backends": ["ort_trainer=ort_trainer.module:ort_backend"],
        },
    )
