"""Moving checkpoints: asynchronous saves, host snapshots, and storage behind fsspec URLs.

- ``_location``: a local path or an fsspec URL (``s3://``, ``memory://``...) behind one small interface,
  with atomic publish (temporary key, then move) and errors that name the URL;
- ``_transfer``: save a tree to a location (remote ones through a local spool file), and local copies of
  remote files for the readers;
- ``_snapshot``: the reusable host copy of a state that an asynchronous save writes from;
- ``_async``: the background writer (one save at a time, errors kept for the next call) and ``SaveHandle``.
"""

from ._async import AsyncWriter, SaveHandle
from ._location import LocalLocation, Location, RemoteLocation, is_url, resolve
from ._snapshot import HostSnapshot
from ._transfer import FileRecord, local_inputs, make_parent_folder, save_tree, write_file

__all__ = [
    "AsyncWriter",
    "FileRecord",
    "HostSnapshot",
    "LocalLocation",
    "Location",
    "RemoteLocation",
    "SaveHandle",
    "is_url",
    "local_inputs",
    "make_parent_folder",
    "resolve",
    "save_tree",
    "write_file",
]
