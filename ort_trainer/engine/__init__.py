"""Running the graphs: the engine a trainer builds at its first step, and the state it binds.

* ``_store``: ``ParamStore``, the flat parameter / gradient / optimizer buffers (from construction on);
* ``_build``: ``build_engine`` exports, builds the gradient graph and opens the sessions (``Engine``);
* ``_session``: ``TrainingSession``, IOBinding of the flat buffers (DLPack, no copies) and the runs;
* ``_distributed``: ``DistributedContext``, the process group, ZeRO partitions and teardown;
* ``_memory``: returning the build's freed scratch to the OS.
"""

from __future__ import annotations

from ._build import BuildRequest, Engine, build_engine
from ._distributed import DistributedContext
from ._store import ParamStore

__all__ = ["BuildRequest", "DistributedContext", "Engine", "ParamStore", "build_engine"]
