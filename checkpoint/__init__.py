"""Checkpoint storage for ort_trainer: HDF5 files compatible with the legacy ORTTrainer.

``save(tree, path)`` writes a nested mapping atomically with per-dataset CRC-32C checksums;
``load(path, key=None)`` reads it back (array data as CPU tensors) after validating the file;
``open_checkpoint(path)`` inspects and reads pieces without loading everything. The on-disk
format is documented in ``checkpoint/format/FORMAT.md``. Distributed saves: ``aggregate_states`` /
``aggregate_checkpoints`` / ``aggregate_to_file`` combine per-rank states into one,
``reshard_state`` and ``megatron.partition[_grid]`` split one, and ``rank_checkpoint_path``,
``manifest_path``, ``write_manifest`` and ``check_manifest`` name and verify the rank files.

``CheckpointManager`` keeps a run directory of numbered checkpoints (keep rules, restore-latest) of a
trainer or of a custom loop's dict of Stateful objects (``objects``: ``save_objects``, ``load_objects``,
``RNGState``); ``io`` moves checkpoints: asynchronous saves (``SaveHandle``) and storage behind fsspec URLs.

Layout: ``format/`` is one file (HDF5 reader/writer, header, codec, schema, user_dict), ``sets/`` the
files of a distributed save (manifest, rank sets, writing a set, aggregation, ZeRO and Megatron
partitioning), ``io/`` async writer, host snapshot and fsspec locations, ``objects/`` checkpoints of a
custom loop's objects, ``manager/`` the
checkpoint manager, ``cli/`` the ``ort-trainer-ckpt`` command (one module per subcommand);
``errors`` is shared by all.
"""

from . import io, objects
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointPickleError,
    CheckpointStorageError,
    CheckpointVersionError,
    CheckpointWriteError,
)
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    CheckpointReader,
    DatasetInfo,
    PartitionInfo,
    TrainerOptionsRecord,
    cleanup_temp_files,
    decode_user_dict,
    encode_user_dict,
    load,
    open_checkpoint,
    save,
)
from .io import SaveHandle
from .manager import CheckpointInfo, CheckpointManager, RestoredCheckpoint
from .sets import (
    AggregationError,
    Manifest,
    ManifestEntry,
    aggregate_checkpoints,
    aggregate_states,
    aggregate_to_file,
    check_manifest,
    manifest_path,
    megatron,
    rank_checkpoint_path,
    read_manifest,
    reshard_state,
    write_manifest,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LEGACY_FORMAT_VERSION",
    "AggregationError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointInfo",
    "CheckpointKeyError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointPickleError",
    "CheckpointReader",
    "CheckpointStorageError",
    "CheckpointVersionError",
    "CheckpointWriteError",
    "DatasetInfo",
    "Manifest",
    "ManifestEntry",
    "PartitionInfo",
    "RestoredCheckpoint",
    "SaveHandle",
    "TrainerOptionsRecord",
    "aggregate_checkpoints",
    "aggregate_states",
    "aggregate_to_file",
    "check_manifest",
    "cleanup_temp_files",
    "decode_user_dict",
    "encode_user_dict",
    "io",
    "load",
    "manifest_path",
    "megatron",
    "objects",
    "open_checkpoint",
    "rank_checkpoint_path",
    "read_manifest",
    "reshard_state",
    "save",
    "write_manifest",
]
