"""Opening a checkpoint for reading while other processes save over it and prune it.

Saves publish a new file by renaming it over the old name, and a manager deletes old checkpoints,
while other processes (a watcher, an evaluator, ``restore``) read. A reader must get the old file or the
new one, whole, and a lock or a vanished file is never reported as damage:

* the file is opened once by descriptor first: its type (a regular file: a FIFO would block for
  ever), its size and the header check all come from that one open file;
* HDF5 then opens the name without file locking (HDF5 takes a shared ``flock`` on read by default,
  which fails while any process holds an exclusive one: a save, or a forked child of a saver);
* HDF5's file must be the inode the descriptor holds: if a save replaced the name in between, the
  open starts again; if the name is gone, the checkpoint was removed: :class:`CheckpointNotFoundError`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import h5py

from ..errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError, CheckpointStorageError
from ._h5_index import h5_guard
from ._header import check_header

__all__ = ["open_h5"]

_ATTEMPTS = 8  # a name replaced this many times in a row while it is opened is reported, not retried
_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@contextlib.contextmanager
def _open_fd(path: Path) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """The file at ``path``, open read-only (non-blocking: a FIFO must not hang), with its stat."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file") from None
    except OSError as exc:
        raise CheckpointStorageError(f"{path}: cannot open the checkpoint ({exc})") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise CheckpointFormatError(f"{path} is a directory, not a checkpoint file")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{path} is not a regular file (a FIFO, socket or device); not a checkpoint")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        yield fh, st


def _has_signature(fh: BinaryIO, size: int) -> bool:
    """HDF5's signature at offset 0, 512, 1024, 2048, ... (after a user block)."""
    offset = 0
    while offset + len(_SIGNATURE) <= size:
        fh.seek(offset)
        if fh.read(len(_SIGNATURE)) == _SIGNATURE:
            return True
        offset = 512 if offset == 0 else offset * 2
    return False


def _still_there(path: Path, st: os.stat_result) -> bool | None:
    """True: ``path`` is still the file of ``st``; False: replaced by another file; None: gone."""
    try:
        return os.path.samestat(os.stat(path), st)
    except FileNotFoundError:
        return None
    except OSError:
        return True


def _opened_file(f: h5py.File) -> os.stat_result | None:
    try:
        handle = f.id.get_vfd_handle()
        return os.fstat(handle) if isinstance(handle, int) else None
    except (OSError, ValueError, RuntimeError, TypeError):
        return None


def _removed(path: Path) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{path}: the checkpoint was removed while it was being opened")


def _attempt(path: Path, verify: bool) -> tuple[h5py.File, bool, int] | None:
    """One try: the open file, whether a verified header covered its metadata, its size; None if replaced."""
    with _open_fd(path) as (fh, st):
        has_header = verify and check_header(path, fh)
        if not _has_signature(fh, st.st_size):
            raise CheckpointFormatError(
                f"{path} is not an HDF5 file; expected a checkpoint written by checkpoint.save or the legacy ORTTrainer"
            )
        try:
            with h5_guard(str(path), "/ (file header)"):
                f = h5py.File(path, "r", locking=False)
        except CheckpointCorruptError:
            there = _still_there(path, st)
            if there is None:
                raise _removed(path) from None
            if there:
                raise
            return None
        opened = _opened_file(f)
        if opened is None or os.path.samestat(opened, st):
            return f, has_header, st.st_size
        f.close()
        return None


def open_h5(path: Path, verify: bool) -> tuple[h5py.File, bool, int]:
    """Open ``path`` read-only: (HDF5 file, whether a verified header covered its metadata, its size).

    With ``verify`` our header's metadata checksum is checked before HDF5 parses anything.
    """
    for _ in range(_ATTEMPTS):
        opened = _attempt(path, verify)
        if opened is not None:
            return opened
    raise CheckpointStorageError(f"{path} was replaced {_ATTEMPTS} times while it was being opened; try again")
