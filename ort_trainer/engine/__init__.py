"""Running the graphs: the engine a trainer builds at its first step, and the state it binds.

* ``_store``: ``ParamStore``, the flat parameter / gradient / optimizer buffers (from construction on);
* ``_build``: ``build_engine`` exports, builds the gradient graph and opens the sessions (``Engine``);
* ``_session``: ``TrainingSession``, IOBinding of the flat buffers (DLPack, no copies) and the runs;
* ``_distributed``: ``DistributedContext``, the process group, ZeRO partitions and teardown;
* ``_memory``: returning the build's freed scratch to the OS;
* ``_trainer_state``: ``TrainerState``, the one object a trainer's parts live in;
* ``_step``: one train/eval step, the distributed update (reduce, ZeRO, clipping, loss-scale skips);
* ``_rank_check``: the per-step check that every rank holds the same state.
"""

from __future__ import annotations

from ._build import BuildRequest, Engine, build_engine
from ._distributed import DistributedContext
from ._store import ParamStore
from ._trainer_state import TrainerState

__all__ = ["BuildRequest", "DistributedContext", "Engine", "ParamStore", "TrainerState", "build_engine"]
