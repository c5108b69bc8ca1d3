"""``CheckpointManager``: a run directory of numbered checkpoints, keep rules, restore-latest.

- ``_manager``: the manager (save + prune after durability, latest / checkpoints / restore);
- ``_policy``: keep rules (last k, every n steps, best k by a metric);
- ``_index``: checkpoint names in the directory, the atomic index of what the manager wrote, the scan.
"""

from ._index import INDEX_NAME, checkpoint_name
from ._manager import Checkpointable, CheckpointInfo, CheckpointManager, RestoredCheckpoint

__all__ = [
    "INDEX_NAME",
    "CheckpointInfo",
    "CheckpointManager",
    "Checkpointable",
    "RestoredCheckpoint",
    "checkpoint_name",
]
