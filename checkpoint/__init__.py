"""Checkpoint storage for ort_trainer: HDF5 files compatible with the legacy ORTTrainer.

``save(tree, path)`` writes a nested mapping atomically with per-dataset CRC-32 checksums;
``load(path, key=None)`` reads it back (array data as CPU tensors) after validating the file;
``open_checkpoint(path)`` inspects and reads pieces without loading everything. The on-disk
format is documented in ``checkpoint/FORMAT.md``. Distributed saves: ``aggregate_states`` /
``aggregate_checkpoints`` / ``aggregate_to_file`` combine per-rank states into one,
``reshard_state`` and ``megatron.partition[_grid]`` split one, and ``rank_checkpoint_path``,
``manifest_path``, ``write_manifest`` and ``check_manifest`` name and verify the rank files.
"""

from . import megatron
from ._h5_reader import CheckpointReader, DatasetInfo, load, open_checkpoint
from ._h5_writer import cleanup_temp_files, save
from ._manifest import (
    Manifest,
    ManifestEntry,
    check_manifest,
    manifest_path,
    rank_checkpoint_path,
    read_manifest,
    write_manifest,
)
from ._schema import FORMAT_NAME, FORMAT_VERSION, LEGACY_FORMAT_VERSION, PartitionInfo, TrainerOptionsRecord
from ._storage import CheckpointStorage, HDF5Storage, InMemoryStorage
from ._user_dict import decode_user_dict, encode_user_dict
from .aggregate import AggregationError, aggregate_checkpoints, aggregate_states, aggregate_to_file, reshard_state
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointPickleError,
    CheckpointVersionError,
)

__all__ = [
    "FORMAT_NAME",
    "AggregationError",
    "Manifest",
    "ManifestEntry",
    "FORMAT_VERSION",
    "LEGACY_FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointPickleError",
    "CheckpointReader",
    "CheckpointStorage",
    "CheckpointVersionError",
    "DatasetInfo",
    "HDF5Storage",
    "InMemoryStorage",
    "PartitionInfo",
    "TrainerOptionsRecord",
    "aggregate_checkpoints",
    "aggregate_states",
    "aggregate_to_file",
    "check_manifest",
    "cleanup_temp_files",
    "decode_user_dict",
    "encode_user_dict",
    "load",
    "manifest_path",
    "megatron",
    "open_checkpoint",
    "rank_checkpoint_path",
    "read_manifest",
    "reshard_state",
    "save",
    "write_manifest",
]
