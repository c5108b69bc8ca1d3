"""Checkpoint storage for ort_trainer: HDF5 files compatible with the legacy ORTTrainer.

``save(tree, path)`` writes a nested mapping atomically with per-dataset CRC-32 checksums;
``load(path, key=None)`` reads it back (array data as CPU tensors) after validating the file;
``open_checkpoint(path)`` inspects and reads pieces without loading everything. The on-disk
format is documented in ``checkpoint/FORMAT.md``.
"""

from ._h5_reader import CheckpointReader, DatasetInfo, load, open_checkpoint
from ._h5_writer import cleanup_temp_files, save
from ._schema import FORMAT_NAME, FORMAT_VERSION, LEGACY_FORMAT_VERSION, PartitionInfo, TrainerOptionsRecord
from ._storage import CheckpointStorage, HDF5Storage, InMemoryStorage
from ._user_dict import decode_user_dict, encode_user_dict
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
    "cleanup_temp_files",
    "decode_user_dict",
    "encode_user_dict",
    "load",
    "open_checkpoint",
    "save",
]
