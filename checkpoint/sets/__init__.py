"""Distributed saves: the per-rank files of one save, their manifest, and aggregation / resharding.

- ``_manifest``: rank file names and the JSON manifest that marks a complete set;
- ``_rankset``: one rank's state as a source (file or memory) and the whole-set consistency check;
- ``_partition`` / ``_assemble``: plan the full state from metadata, then read it tensor by tensor;
- ``_aggregate``: the public aggregation functions (in memory, or streamed to a file);
- ``_per_rank``: the sections each rank saves for itself (``user_dict``, ``stateful``), kept per rank;
- ``_zero`` / ``megatron``: split a full state by the ZeRO flat-buffer layout / by Megatron slices.
"""

from . import megatron
from ._aggregate import (
    AggregationError,
    FileSource,
    aggregate_checkpoints,
    aggregate_states,
    aggregate_to_file,
    reshard_state,
)
from ._manifest import (
    Manifest,
    ManifestEntry,
    check_manifest,
    file_crc32,
    is_manifest,
    manifest_bytes,
    manifest_path,
    rank_checkpoint_path,
    rank_file_name,
    read_manifest,
    split_suffix,
    write_manifest,
)
from ._partition import plan_aggregation
from ._per_rank import own_rank_section
from ._rankset import read_rank_set

__all__ = [
    "AggregationError",
    "FileSource",
    "Manifest",
    "ManifestEntry",
    "aggregate_checkpoints",
    "aggregate_states",
    "aggregate_to_file",
    "check_manifest",
    "file_crc32",
    "is_manifest",
    "manifest_bytes",
    "manifest_path",
    "megatron",
    "own_rank_section",
    "plan_aggregation",
    "rank_checkpoint_path",
    "rank_file_name",
    "read_manifest",
    "read_rank_set",
    "reshard_state",
    "split_suffix",
    "write_manifest",
]
