"""Where training graphs come from: the registry of graph sources (`_protocols.GraphSource`) and the choice.

Each engine is a wing of its own, registered here by the module that holds its source, and imported only when
it is chosen (its ``SOURCE``):

* ``"onnxblock"`` (``engine.onnxblock``): the TorchScript exporter + ONNX Runtime's C++ gradient builder
  (``onnxruntime-training`` 1.19.2, the last release; Python 3.11/3.12 on x86-64 Linux only);
* ``"autograd"`` (``engine.autograd``): the forward and backward traced from PyTorch's own autograd and exported
  with the dynamo exporter, run by any ``onnxruntime`` (stock 1.2x-1.3x, GPU builds, every Python and platform).

``choose_engine("auto")`` takes onnxblock where onnxruntime-training is installed (the engine existing runs
were built with) and autograd elsewhere. `graph_source` gives the chosen one, which checks what it supports at
construction (`GraphSource.check_supported`) and builds the `Engine` at the first step (`build_engine`).
A third source is one more entry of `_REGISTRY` (and of ``utils.engine``'s accepted names).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ort_trainer._package.runtimes import runtime_conflict

from ._protocols import GraphSource

if TYPE_CHECKING:
    from ._build import BuildRequest, Engine

__all__ = ["ENGINES", "build_engine", "choose_engine", "graph_source", "onnxblock_available"]

# name -> the module whose ``SOURCE`` is the graph source (imported on first use: a wing loads only when chosen)
_REGISTRY: dict[str, str] = {"onnxblock": "ort_trainer.engine.onnxblock", "autograd": "ort_trainer.engine.autograd"}
ENGINES = ("auto", *_REGISTRY)


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
    if requested != "auto" and requested not in _REGISTRY:
        raise ValueError(f"utils.engine must be one of {['auto', *_REGISTRY]}, got {requested!r}")
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
    """The graph source registered under ``name`` ("onnxblock", "autograd" or a registered one)."""
    try:
        module = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no graph source {name!r}; known: {sorted(_REGISTRY)}") from None
    return importlib.import_module(module).SOURCE


def build_engine(request: BuildRequest, sample_inputs: Sequence[torch.Tensor]) -> Engine:
    """The engine of ``request.engine``'s graph source, traced/exported with the first step's inputs."""
    return graph_source(request.engine).build(request, sample_inputs)
