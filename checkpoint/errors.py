"""Exceptions raised by the checkpoint package.

Every exception derives from :class:`CheckpointError` (itself a ``ValueError``) so callers can
catch one type, and every message names the file it is about.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointPickleError",
    "CheckpointStorageError",
    "CheckpointVersionError",
]


class CheckpointError(ValueError):
    """Base class of every checkpoint error."""


class CheckpointCorruptError(CheckpointError):
    """The file is damaged: checksum mismatch, truncation or an unreadable object."""


class CheckpointFormatError(CheckpointError):
    """The file is not HDF5, not a checkpoint, uses an unknown layout, or holds refused objects."""


class CheckpointVersionError(CheckpointError):
    """The file was written by a newer format version than this library supports."""


class CheckpointPickleError(CheckpointError):
    """The file holds pickled content and ``allow_pickle=True`` was not given."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """``save`` was asked to write over an existing file without ``overwrite=True``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""


class CheckpointKeyError(CheckpointError, KeyError):
    """A key asked for (partial load) is not in the file; the message lists the keys present."""

    def __str__(self) -> str:
        # KeyError.__str__ would show the repr of the message (quotes, escaped backslashes).
        return str(self.args[0]) if self.args else ""


class CheckpointStorageError(CheckpointError, OSError):
    """The storage behind a path or URL failed: no filesystem installed for a URL's scheme, missing
    credentials, a refused or failed upload/download. The message names the URL."""
