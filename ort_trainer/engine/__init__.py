"""Running the graphs: the engine a trainer builds at its first step, and the state it binds.

* ``_store``: ``ParamStore``, the flat parameter / gradient / optimizer buffers (from construction on);
* ``_protocols``: the seams: ``GraphSource`` (where graphs come from) and ``ModelParallel``;
* ``_sources``: the two graph sources, ``choose_engine`` and ``build_engine`` (the chosen source's ``Engine``);
* ``_build``: ``BuildRequest``, ``Engine`` and the onnxblock build;
* ``_bindings``: ``BindingGuard``, before each step: rebind when the buffers' storage moved, refuse a shared
  module that no longer shows the trainer's buffers;
* ``_session``: ``TrainingSession``, IOBinding of the flat buffers (DLPack, no copies) and the runs;
* ``_onnxblock_graphs``: the gradient graph from onnxruntime-training's onnxblock (imported only by that engine);
* ``_autograd_build`` / ``_autograd_session``: the autograd engine (graphs from PyTorch's autograd, any
  onnxruntime): its build, and its session over the same buffers;
* ``_distributed``: ``DistributedContext``, the process group, ZeRO partitions and teardown;
* ``_memory``: returning the build's freed scratch to the OS;
* ``_trainer_state``: ``TrainerState``, the one object a trainer's parts live in;
* ``_step``: one train/eval step, the distributed update (reduce, ZeRO, clipping, loss-scale skips);
* ``_rank_check``: the per-step check that every rank holds the same state.
"""

from __future__ import annotations

from ._build import BuildRequest, Engine
from ._distributed import DistributedContext
from ._protocols import GraphSource, ModelParallel
from ._session import DeviceSpec, resolve_device, to_ortvalue
from ._sources import ENGINES, build_engine, choose_engine, onnxblock_available
from ._store import ParamStore
from ._trainer_state import TrainerState

__all__ = [
    "ENGINES",
    "BuildRequest",
    "DeviceSpec",
    "DistributedContext",
    "Engine",
    "GraphSource",
    "ModelParallel",
    "ParamStore",
    "TrainerState",
    "build_engine",
    "choose_engine",
    "onnxblock_available",
    "resolve_device",
    "to_ortvalue",
]
