"""Moving checkpoints: asynchronous saves, host snapshots, rank-set writes, storage behind fsspec URLs.

Imports go one way: ``io`` uses ``sets`` (manifests) and ``format`` (the file writer); neither imports ``io``.

- ``_location``: the storage seam: the ``Location`` protocol (call order and promises) and its two
  implementations, a local path or an fsspec URL (``s3://``, ``memory://``...) with atomic publish (temporary
  key, then move) and errors that name the URL; ``register_scheme`` adds a backend;
- ``_transfer``: save a tree to a location (remote ones through a local spool file), and local copies of
  remote files for the readers;
- ``_snapshot``: the reusable host copy of a state that an asynchronous save writes from;
- ``_stale``: leftovers of killed remote saves (spool folders, temporary objects), removed by later saves;
- ``_async``: the background writer (one save at a time, errors kept for the next call) and ``SaveHandle``;
- ``_set_writer``: a distributed save (agree on the target, every rank writes its file, rank 0 the manifest);
- ``_scheduler``: ``SaveScheduler``, which schedules a trainer's saves (now or in the background, one file or one
  file per rank) and ``write_checkpoint``.
"""

from ._async import AsyncWriter, SaveHandle
from ._location import LocalFile, LocalLocation, Location, RemoteLocation, RemoteStore, is_url, register_scheme, resolve
from ._scheduler import SaveScheduler, write_checkpoint
from ._set_writer import remove_set
from ._snapshot import HostSnapshot
from ._transfer import (
    FileRecord,
    local_inputs,
    make_parent_folder,
    read_manifest_at,
    save_tree,
    spool_folder,
    write_file,
)

__all__ = [
    "AsyncWriter",
    "FileRecord",
    "HostSnapshot",
    "LocalFile",
    "LocalLocation",
    "Location",
    "RemoteLocation",
    "RemoteStore",
    "SaveHandle",
    "SaveScheduler",
    "is_url",
    "local_inputs",
    "make_parent_folder",
    "read_manifest_at",
    "register_scheme",
    "remove_set",
    "resolve",
    "save_tree",
    "spool_folder",
    "write_checkpoint",
    "write_file",
]
