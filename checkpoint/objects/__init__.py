"""Checkpoints of a custom training loop: a dict of objects with ``state_dict()`` / ``load_state_dict()``.

- ``_kinds``: what each object is (module, optimizer, ZeRO optimizer, other), wrappers looked through;
- ``_save``: the tree of one file (or of this rank's file of a set) and who writes it;
- ``_restore``: read (aggregating a set), validate everything, then load everything or nothing;
- ``_zero``: a ``ZeroRedundancyOptimizer``'s shard by global parameter index, and the united state;
- ``_group``: rank and world size of the default process group;
- ``_rng``: :class:`RNGState`, the process's generators as one Stateful object;
- ``_api``: :func:`save_objects`, :func:`load_objects`, and the manager's adapter.

Design and file layout: docs/custom_loop_checkpoints.md and ``format/FORMAT.md``.
"""

from ._api import ObjectsCheckpointable, load_objects, save_objects
from ._rng import RNGState

__all__ = ["ObjectsCheckpointable", "RNGState", "load_objects", "save_objects"]
