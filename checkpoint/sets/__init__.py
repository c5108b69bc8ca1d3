"""Distributed saves: the per-rank files of one save, their manifest, and aggregation / resharding.

- ``_manifest``: rank file names and the JSON manifest that marks a complete set;
- ``_rankset``: one rank's state as a source (file or memory) and the whole-set consistency check;
- ``_partition`` / ``_assemble``: plan the full state from metadata, then read it tensor by tensor;
- ``_aggregate``: the public aggregation functions (in memory, or streamed to a file);
- ``_zero`` / ``megatron``: split a full state by the ZeRO flat-buffer layout / by Megatron slices.
"""

from . import megatron
from ._aggregate import AggregationError, aggregate_checkpoints, aggregate_states, aggregate_to_file, reshard_state
from ._manifest import (
    Manifest,
    ManifestEntry,
    check_manifest,
    is_manifest,
    manifest_path,
    rank_checkpoint_path,
    read_manifest,
    write_manifest,
)
from ._per_rank import own_rank_section

__all__ = [
    "AggregationError",
    "Manifest",
    "ManifestEntry",
    "aggregate_checkpoints",
    "aggregate_states",
    "aggregate_to_file",
    "check_manifest",
    "is_manifest",
    "manifest_path",
    "megatron",
    "own_rank_section",
    "rank_checkpoint_path",
    "read_manifest",
    "reshard_state",
    "write_manifest",
]
