"""Running the graphs: the engine a trainer builds at its first step, and the state it binds.

* ``_store``: ``ParamStore``, the flat parameter / gradient / optimizer buffers (from construction on);
* ``_sources``: the seams: ``GraphSource`` (where graphs come from: ``choose_engine``) and ``ModelParallel``;
* ``_build``: ``build_engine`` (``Engine``) hands the build to the chosen source; the onnxblock build;
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

from ._build import BuildRequest, Engine, build_engine
from ._distributed import DistributedContext
from ._sources import ENGINES, GraphSource, ModelParallel, choose_engine, onnxblock_available
from ._store import ParamStore
from ._trainer_state import TrainerState

__all__ = [
    "ENGINES",
    "BuildRequest",
    "DistributedContext",
    "Engine",
    "GraphSource",
    "ModelParallel",
    "ParamStore",
    "TrainerState",
    "build_engine",
    "choose_engine",
    "onnxblock_available",
]
