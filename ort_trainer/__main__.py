"""``python -m ort_trainer``: what this installation runs on (versions, execution providers, threads).

Paste its output into a bug report. The checkpoint tool is ``python -m ort_trainer.checkpoint``
(or ``ort-trainer-ckpt``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

from . import __version__
from ._package.versions import newer_than_tested

__all__ = ["describe", "main"]

_DISTRIBUTIONS = (
    "torch", "onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnx", "onnxscript", "numpy", "h5py",
    "onnx-ir", "safetensors", "fsspec", "transformers",
)  # fmt: skip


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe() -> list[str]:
    """The report's lines: versions, ONNX Runtime execution providers, CPU count and thread settings."""
    import onnxruntime
    import torch

    lines = [f"ort_trainer {__version__} ({os.path.dirname(os.path.abspath(__file__))})"]
    lines.append(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    lines += [f"{name} {_installed(name)}" for name in _DISTRIBUTIONS]
    for name, (version, tested) in newer_than_tested().items():
        lines.append(
            f"warning: {name} {version} is newer than the newest release CI has run ({tested}); if a step fails, "
            f"report it with this output and try pip install '{name}=={tested}'"
        )
    lines.append(f"onnxruntime execution providers: {', '.join(onnxruntime.get_available_providers())}")
    from .engine import choose_engine

    lines.append(f"engine (utils.engine='auto'): {choose_engine('auto')}")
    cuda = f"cuda {torch.version.cuda}, {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "no"
    lines.append(f"torch CUDA: {cuda}")
    lines.append(
        f"threads: {os.cpu_count()} CPUs, torch intra-op {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ort_trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ort_trainer {__version__}")
    parser.parse_args(argv)
    print("\n".join(describe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
