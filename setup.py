"""ort_trainer: train PyTorch models on ONNX Runtime, with checkpoints you can trust.

One top-level import package, ``ort_trainer``. Its subpackages ``ort_trainer.checkpoint``,
``ort_trainer.optim`` and ``ort_trainer.amp`` keep their folders at the top of the repository
(``checkpoint/``, ``optim/``, ``amp/``) and are mapped into the namespace by ``package_dir``.
"""

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


PACKAGES, PACKAGE_DIR = _packages()

setup(
    name="ort_trainer",
    version="0.1.0",
    description="Train PyTorch or ONNX models on ONNX Runtime; HDF5 checkpoints with ZeRO/Megatron aggregation.",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"ort_trainer.checkpoint.format": ["FORMAT.md"]},
    python_requires=">=3.11",
    install_requires=[
        "torch==2.13.0",
        "onnxruntime-training==1.19.2",
        "onnx==1.17.0",
        "numpy",
        "h5py",
        "tqdm",
        "crc32c",
    ],
    extras_require={
        # checkpoints at fsspec URLs (memory://, file://, ...); s3:// needs s3fs too
        "fsspec": ["fsspec"],
        "s3": ["fsspec", "s3fs"],
        # ort_trainer.hf.Trainer: transformers.Trainer on ONNX Runtime (docs/hf.md)
        "hf": ["transformers>=5,<6", "accelerate>=1.1"],
    },
    entry_points={"console_scripts": ["ort-trainer-ckpt=ort_trainer.checkpoint.__main__:main"]},
)
