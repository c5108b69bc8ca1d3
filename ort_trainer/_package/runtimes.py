"""Which ONNX Runtime package is installed: the stock ``onnxruntime`` (or ``onnxruntime-gpu``) or
``onnxruntime-training``, and never two of them over each other.

All of them install the same ``onnxruntime`` module; pip lets a second one overwrite the first one's files,
which leaves a runtime of mixed parts (a stock build with half of the training package's Python files,
or the reverse). `runtime_conflict` reads the installed distributions' metadata (no import, milliseconds)
and the trainer refuses to start in such an environment, saying how to repair it.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata

__all__ = ["RUNTIME_DISTRIBUTIONS", "installed_runtimes", "runtime_conflict"]

RUNTIME_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu")


def installed_runtimes(path: Sequence[str] | None = None) -> dict[str, str]:
    """``{distribution: version}`` of the ONNX Runtime packages installed (on ``path``, default ``sys.path``)."""
    found = {}
    where = {} if path is None else {"path": list(path)}
    for wanted in RUNTIME_DISTRIBUTIONS:  # by name: reading every installed package's metadata took 0.1 s
        for dist in metadata.distributions(name=wanted, **where):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if name in RUNTIME_DISTRIBUTIONS:
                found.setdefault(name, dist.version)
    return found


def runtime_conflict(path: Sequence[str] | None = None) -> str | None:
    """A message naming the runtimes installed over each other and how to repair that, or None."""
    runtimes = installed_runtimes(path)
    if len(runtimes) < 2:
        return None
    listed = ", ".join(f"{name} {version}" for name, version in sorted(runtimes.items()))
    names = " ".join(sorted(runtimes))
    return (
        f"several ONNX Runtime packages are installed over each other ({listed}); they share the onnxruntime "
        f"module, so its files are now a mix of them. Repair: pip uninstall -y {names}, then install one: "
        "pip install 'onnxruntime>=1.31' (any Python/platform, the autograd engine) or pip install "
        "onnxruntime-training==1.19.2 onnx==1.17.0 (Python 3.11/3.12 x86-64 Linux, both engines; docs/engines.md)"
    )
