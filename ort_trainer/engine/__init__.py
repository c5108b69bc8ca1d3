"""Running the graphs: the runtime core of a trainer, and the two engine wings behind one seam.

The core (this package's modules) holds what every engine shares:

* ``_trainer_state``: ``TrainerState``, the one object a trainer's parts live in; ``_assembly``:
  ``assemble_trainer_state``, the constructor's work (options, refusals, process group, store) that fills it;
* ``_store``: ``ParamStore``, the flat parameter / gradient / optimizer buffers (from construction on);
* ``_protocols``: the seams: ``GraphSource`` (where graphs come from), ``ModelParallel``; ``_step_session``:
  ``StepSession``, what every session does for a step;
* ``_sources``: the registry of graph sources by name, ``choose_engine`` and ``build_engine``;
* ``_build``: ``BuildRequest`` and ``Engine`` (what every source builds from and into);
* ``_bindings``: ``BindingGuard``, before each step: rebind when the buffers' storage moved, refuse a shared
  module that no longer shows the trainer's buffers;
* ``_step``: one train/eval step, the distributed update (reduce, ZeRO, clipping, loss-scale skips);
* ``_rank_check``: the per-step check that every rank holds the same state;
* ``_distributed``: ``DistributedContext``, the process group, ZeRO partitions and teardown;
* ``_random``: Dropout's random state as a function of (run seed, rank, step);
* ``_progress``: each build phase logged with its duration (a tqdm bar on a terminal).

The wings, each imported only through the registry when it is chosen (docs/architecture.md):

* ``autograd``: PyTorch's autograd exported for any onnxruntime (its graphs: ``graph.autograd``);
* ``onnxblock``: onnxruntime-training's gradient builder (its graphs: ``graph.onnxblock``; Megatron:
  ``onnxblock.parallel``, public as ``ort_trainer.parallel``).

ONNX Runtime plumbing (devices, DLPack, output binding, the shared arena, fork safety) is ``ort_trainer.runtime``.
"""

from __future__ import annotations

from ._assembly import assemble_trainer_state
from ._build import BuildRequest, Engine, session_options_for
from ._distributed import DistributedContext, buckets, init_process_group
from ._protocols import GraphSource, ModelParallel, ModelParallelFactory
from ._random import agreed_run_seed
from ._rank_check import note_load
from ._sources import ENGINES, build_engine, choose_engine, graph_source, onnxblock_available
from ._step import eval_step, train_step
from ._step_session import StepSession
from ._store import ParamStore, build_store
from ._trainer_state import TrainerState

__all__ = [
    "ENGINES",
    "BuildRequest",
    "DistributedContext",
    "Engine",
    "GraphSource",
    "ModelParallel",
    "ModelParallelFactory",
    "ParamStore",
    "StepSession",
    "TrainerState",
    "agreed_run_seed",
    "assemble_trainer_state",
    "buckets",
    "build_engine",
    "build_store",
    "choose_engine",
    "eval_step",
    "graph_source",
    "init_process_group",
    "note_load",
    "onnxblock_available",
    "session_options_for",
    "train_step",
]
