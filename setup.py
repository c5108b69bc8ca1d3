"""ort_trainer: train PyTorch models on ONNX Runtime, with checkpoints you can trust."""

from setuptools import setup

setup(
    name="ort_trainer",
    version="0.1.0",
    description="Train PyTorch or ONNX models on ONNX Runtime; HDF5 checkpoints with ZeRO/Megatron aggregation.",
    packages=["ort_trainer", "optim", "amp", "checkpoint"],
    package_data={"checkpoint": ["FORMAT.md"]},
    python_requires=">=3.11",
    install_requires=[
        "torch==2.13.0",
        "onnxruntime-training==1.19.2",
        "onnx==1.17.0",
        "numpy",
        "h5py",
        "tqdm",
    ],
    entry_points={"console_scripts": ["ort-trainer-ckpt=checkpoint.__main__:main"]},
)
