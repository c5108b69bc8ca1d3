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
    "CheckpointWriteError",
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


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed in the operating system: the device is full, a file size limit was hit, an I/O error.

    It is an ``OSError`` too, with ``errno`` (e.g. ``errno.ENOSPC``, ``errno.EFBIG``) and ``filename``
    (the checkpoint path asked for). The previous checkpoint at that path is intact and the save's
    temporary file has been removed.
    """

    def __init__(self, error_number: int | None, message: str, filename: str) -> None:
        OSError.__init__(self, error_number, message)  # sets errno and strerror (ValueError's init would not)
        self.filename = filename
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # pickle (e.g. across processes) with the three arguments
        return type(self), (self.errno, self.message, self.filename)


class CheckpointStorageError(CheckpointError, OSError):
    """The storage behind a path or URL failed: no filesystem installed for a URL's scheme, missing
    credentials, a refused or failed upload/download. The message names the URL."""
