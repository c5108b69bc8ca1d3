"""One checkpoint file: the HDF5 format (see ``FORMAT.md`` beside this file).

- ``schema``: key names, attribute names and typed records (the only place they are spelled); public
  as ``format.schema``;
- ``_codec``: one value <-> one HDF5 dataset, key escaping;
- ``_checksum``: per-dataset checksums (CRC-32C; CRC-32 for format version 1) and their verification;
- ``_header``: the checksummed header in the HDF5 user block, checked before HDF5 parses anything;
- ``_h5_lowlevel`` / ``_h5_index``: fast h5py calls, and the one-pass safety scan + structure digest;
- ``_h5_checks``: what a dataset may be (no filters, sizes bounded by the file, attributes that fit);
- ``_h5_writer`` / ``_h5_stream``: atomic saves of a tree / of values produced one at a time;
- ``_atomic`` / ``_tempfile``: one save's locked temporary file, raw writes, space reservation,
  publish, disk-full errors, and the removal of stale temporary files;
- ``_h5_reader``: validated, checksummed reading (whole tree, one key, or straight into a buffer);
- ``_user_dict``: the pickle-free encoding of ``user_dict``;
- ``_h5_open``: opening for reading while other processes save over the file and prune it;
- ``_fork_guard``: a process forked during a save never writes into the file that save publishes;
- ``lazy_torch``: ``torch`` imported on first use (the read-only CLI commands never load it); public for the
  rooms above;
- ``files``: the file rules every writer follows (temporary names, the pid check, fsync, publish, target check);
"""

from . import schema
from ._codec import numpy_dtype_name
from ._h5_reader import CheckpointReader, DatasetInfo, load, open_checkpoint
from ._h5_stream import save_stream
from ._h5_writer import cleanup_temp_files, save, save_to_checked_target
from ._user_dict import decode_user_dict, decode_user_value, encode_user_dict, encode_user_value
from .schema import FORMAT_NAME, FORMAT_VERSION, LEGACY_FORMAT_VERSION, PartitionInfo, TrainerOptionsRecord

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LEGACY_FORMAT_VERSION",
    "CheckpointReader",
    "DatasetInfo",
    "PartitionInfo",
    "TrainerOptionsRecord",
    "cleanup_temp_files",
    "decode_user_dict",
    "decode_user_value",
    "encode_user_dict",
    "encode_user_value",
    "load",
    "numpy_dtype_name",
    "open_checkpoint",
    "save",
    "save_stream",
    "save_to_checked_target",
    "schema",
]
