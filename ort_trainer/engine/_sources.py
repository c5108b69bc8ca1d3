"""Where training graphs come from: the two graph sources (`_protocols.GraphSource`) and the choice between them.

Two graph sources build an `Engine` from a `BuildRequest` and the first step's inputs:

* ``"onnxblock"``: the TorchScript exporter + ONNX Runtime's C++ gradient builder (``onnxruntime-training``
  1.19.2, the last release; Python 3.11/3.12 on x86-64 Linux only);
* ``"autograd"``: the forward and backward traced from PyTorch's own autograd and exported with the dynamo
  exporter, run by any ``onnxruntime`` (stock 1.2x-1.3x, GPU builds, every Python and platform they ship for).

``choose_engine("auto")`` takes onnxblock where onnxruntime-training is installed (the engine existing runs
were built with) and autograd elsewhere. `build_engine` hands a request to the chosen source.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ort_trainer._package.runtimes import runtime_conflict

from ._protocols import GraphSource

if TYPE_CHECKING:
    from ._build import BuildRequest, Engine

__all__ = ["ENGINES", "build_engine", "choose_engine", "graph_source", "onnxblock_available"]

ENGINES = ("auto", "onnxblock", "autograd")


class _Onnxblock:
    name = "onnxblock"

    def build(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
        from ._build import build_onnxblock_engine

        return build_onnxblock_engine(request, sample_inputs)


class _Autograd:
    name = "autograd"

    def build(self, request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
        from ._autograd_build import build_autograd_engine

        return build_autograd_engine(request, sample_inputs)


_SOURCES: dict[str, GraphSource] = {"onnxblock": _Onnxblock(), "autograd": _Autograd()}


def onnxblock_available() -> bool:
    """Whether ``onnxruntime.training`` (the onnxruntime-training package) is importable here."""
    try:
        return importlib.util.find_spec("onnxruntime.training") is not None
    except (ImportError, ValueError):
        return False


def choose_engine(requested: str) -> str:
    """The engine to build: ``requested``, or for ``"auto"`` what works on the installed runtime.

    ValueError for an unknown name, or for ``"onnxblock"`` without onnxruntime-training (saying how to get it);
    ImportError when two ONNX Runtime packages are installed over each other (`_package.runtimes`).
    """
    if requested not in ENGINES:
        raise ValueError(f"utils.engine must be one of {list(ENGINES)}, got {requested!r}")
    conflict = runtime_conflict()
    if conflict is not None:
        raise ImportError(conflict)
    if requested == "auto":
        return "onnxblock" if onnxblock_available() else "autograd"
    if requested == "onnxblock" and not onnxblock_available():
        raise ValueError(
            "utils.engine='onnxblock' needs onnxruntime-training, which is not installed (this environment has "
            "the stock onnxruntime). Use engine='autograd' (or 'auto'), or install the onnxblock runtime in "
            "place of the stock one: pip uninstall -y onnxruntime && pip install onnxruntime-training==1.19.2 "
            "onnx==1.17.0 (Python 3.11/3.12, x86-64 Linux; docs/engines.md)"
        )
    return requested


def graph_source(name: str) -> GraphSource:
    """The graph source registered under ``name`` ("onnxblock" or "autograd")."""
    try:
        return _SOURCES[name]
    except KeyError:
        raise ValueError(f"no graph source {name!r}; known: {sorted(_SOURCES)}") from None


def build_engine(request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
    """The engine of ``request.engine``'s graph source, traced/exported with the first step's inputs."""
    return graph_source(request.engine).build(request, sample_inputs)
