"""Running the graphs: the engine a trainer builds at its first step, and the state it binds.

* ``_store``: ``ParamStore``, the flat parameter / gradient / optimizer buffers (from construction on);
* ``_protocols``: the seams: ``GraphSource`` (where graphs come from) and ``ModelParallel``;
* ``_sources``: the two graph sources, ``choose_engine`` and ``build_engine`` (the chosen source's ``Engine``);
* ``_build``: ``BuildRequest``, ``Engine`` and the onnxblock build;
* ``_bindings``: ``BindingGuard``, before each step: rebind when the buffers' storage moved, refuse a shared
  module that no longer shows the trainer's buffers;
* ``_session``: ``TrainingSession``, IOBinding of the flat buffers and the runs; ``_dlpack``: torch tensors as
  ``OrtValue``s and back without copies, on every onnxruntime release we support;
* ``_onnxblock_graphs``: the gradient graph from onnxruntime-training's onnxblock (imported only by that engine);
* ``_autograd_build`` / ``_autograd_session`` / ``_autograd_precision``: the autograd engine (graphs from
  PyTorch's autograd, any onnxruntime): its build, its session over the same buffers, and its mixed precision
  on the provider at hand;
* ``_distributed``: ``DistributedContext``, the process group, ZeRO partitions and teardown;
* ``_memory``: returning the build's freed scratch to the OS; ``_shared_arena``: one CPU arena for the sessions
  we make (a trainer's training and eval graphs, ORTModule's forward and backward);
* ``_progress``: each build phase logged with its duration (a tqdm bar on a terminal);
* ``_random``: Dropout's random state as a function of (run seed, rank, step);
* ``_fork_safety``: a process forked from a trainer frees and exits without hanging in ONNX Runtime;
* ``_trainer_state``: ``TrainerState``, the one object a trainer's parts live in; ``_assembly``:
  ``assemble_trainer_state``, the constructor's work (options, refusals, process group, store) that fills it;
* ``_step``: one train/eval step, the distributed update (reduce, ZeRO, clipping, loss-scale skips);
* ``_rank_check``: the per-step check that every rank holds the same state.
"""

from __future__ import annotations

from ._assembly import assemble_trainer_state
from ._autograd_build import check_autograd_supported, exported_graph
from ._build import BuildRequest, Engine, session_options_for
from ._distributed import DistributedContext, buckets, init_process_group
from ._dlpack import DLPACK_ROUTE, from_ortvalue, to_ortvalue
from ._fork_safety import track
from ._protocols import GraphSource, ModelParallel, ModelParallelFactory
from ._random import agreed_run_seed
from ._rank_check import note_load
from ._session import DeviceSpec, resolve_device
from ._shared_arena import use_shared_cpu_arena
from ._sources import ENGINES, build_engine, choose_engine, onnxblock_available
from ._step import eval_step, train_step
from ._store import ParamStore, build_store
from ._trainer_state import TrainerState

__all__ = [
    "assemble_trainer_state",
    "BuildRequest",
    "DLPACK_ROUTE",
    "DeviceSpec",
    "DistributedContext",
    "ENGINES",
    "Engine",
    "GraphSource",
    "ModelParallel",
    "ModelParallelFactory",
    "ParamStore",
    "TrainerState",
    "agreed_run_seed",
    "init_process_group",
    "buckets",
    "build_engine",
    "build_store",
    "check_autograd_supported",
    "exported_graph",
    "choose_engine",
    "eval_step",
    "from_ortvalue",
    "note_load",
    "onnxblock_available",
    "resolve_device",
    "session_options_for",
    "to_ortvalue",
    "use_shared_cpu_arena",
    "track",
    "train_step",
]
