"""The life of one save's file: a locked temporary file, written, reserved, stamped, synced, published.

Two nested ``with`` blocks, no callbacks: :func:`atomic_file` removes stale temporary files in the
folder, creates and locks the temporary file, and publishes it under the final name in one atomic step
(then fsyncs the folder) when its block ends cleanly; inside it, :func:`checkpoint_body` gives the writer
the HDF5 file (HDF5 writes the metadata, the array bytes are written by :class:`RawWriter` with their
checksum computed on the way) and on the way out reserves the whole file's space before HDF5 flushes its
metadata, stamps the header and fsyncs the file.

Why the array bytes do not go through HDF5: an I/O error inside HDF5 (a full disk) can surface when it
closes a dataset or the file, and HDF5 then keeps handles that crash the process when freed. Here every
byte HDF5 still has to write at close lies in space reserved beforehand (``posix_fallocate``), HDF5's
sieve buffer is off (its raw writes reach the file at the call), and a full disk shows up as an
``OSError`` from our own ``pwrite`` or ``posix_fallocate``: it becomes a :class:`CheckpointWriteError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from functools import cache
from importlib import metadata
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5f, h5p

from ..errors import CheckpointError, CheckpointWriteError
from . import schema as S
from ._checksum import CRC32C
from ._fork_guard import close_written, open_for_write
from ._h5_index import Node, tree_digest
from ._header import userblock_size, write_header
from ._tempfile import LockedTempFile, remove_stale_temp_files
from .files import publish, temp_path

__all__ = ["CheckpointBody", "RawWriter", "atomic_file", "checkpoint_body"]

CHECKSUM = CRC32C  # what every new file carries (format version 2)
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+)")
_REASONS = {
    errno.ENOSPC: "no space left on device (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EFBIG: "file size limit exceeded (EFBIG: the file system's largest file, or RLIMIT_FSIZE)",
}


@cache
def library_version() -> str:
    """Version of the installed ort_trainer distribution (stamped into every file)."""
    try:
        return metadata.version("ort_trainer")
    except metadata.PackageNotFoundError:
        return "unknown"


class RawWriter:
    """Writes array bytes straight into the temporary file, checksumming each piece as it goes out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ranges: list[tuple[int, int]] = []  # (offset, length) of the array bytes written

    def write(self, dsid: h5d.DatasetID, array: np.ndarray) -> int:
        """Write ``array`` into the space HDF5 allocated for ``dsid``; return the array's checksum."""
        if array.nbytes == 0:
            return 0
        offset = dsid.get_offset()
        if offset is None or dsid.get_storage_size() != array.nbytes:
            raise RuntimeError(f"HDF5 allocated {dsid.get_storage_size()} bytes at {offset} for {array.nbytes}")
        crc, pos = 0, offset
        for piece in CHECKSUM.pieces(array):
            crc = CHECKSUM.extend(crc, piece)  # the piece is still in the cache when it is written
            _pwrite_all(self.fd, piece, pos)
            pos += len(piece)
        self.ranges.append((offset, array.nbytes))
        return crc


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset}")
        view, offset = view[written:], offset + written


def _gaps(end: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (offset, length) pieces of [0, end) that ``ranges`` do not cover."""
    gaps, pos = [], 0
    for offset, length in sorted(ranges):
        if offset > pos:
            gaps.append((pos, offset - pos))
        pos = max(pos, offset + length)
    if end > pos:
        gaps.append((pos, end - pos))
    return gaps


def _reserve(fd: int, end: int, written: list[tuple[int, int]]) -> None:
    """Allocate every byte of [0, end) that was not written yet, so that HDF5's last writes cannot fail."""
    for offset, length in _gaps(end, written):
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


def _create_h5(path: Path, ub_size: int) -> h5py.File:
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)  # h5py's default: readable by HDF5 1.8+
    fapl.set_sieve_buf_size(0)  # raw writes reach the file at the call, none is left for close
    fapl.set_file_locking(False, True)  # the save holds its own lock on the file
    fcpl = h5p.create(h5p.FILE_CREATE)
    fcpl.set_userblock(ub_size)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5f.create(os.fsencode(path), h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


class CheckpointBody:
    """The HDF5 file inside the locked temporary file while the writer creates its objects.

    The writer creates every group and dataset through ``file`` (array bytes through ``raw``) and sets
    ``root`` to the index it built; :func:`checkpoint_body` then writes the root attributes, the
    structure digest, reserves the file's space, stamps the header and fsyncs.
    """

    def __init__(self, tmp: LockedTempFile, max_leaves: int) -> None:
        self.tmp, self.ub_size = tmp, userblock_size(max_leaves)
        self.raw = RawWriter(tmp.fd)
        # registered for the whole time it is open: a process forked meanwhile must never write into it
        self.file = open_for_write(lambda: _create_h5(tmp.path, self.ub_size), (tmp.fd,))
        self.root: Node | None = None

    def _finish(self) -> None:
        if self.root is None:
            raise RuntimeError(f"the writer of {self.tmp.path.name} did not set the root index")
        root_attrs = {
            S.ATTR_FORMAT: S.FORMAT_NAME,
            S.ATTR_FORMAT_VERSION: S.FORMAT_VERSION,
            S.ATTR_LIBRARY_VERSION: library_version(),
        }
        self.file.attrs.update(root_attrs)
        self.file.attrs[S.ATTR_TREE_CRC32] = np.uint32(tree_digest(self.root, root_attrs))
        _reserve(self.tmp.fd, self.file.id.get_filesize(), self.raw.ranges)


@contextlib.contextmanager
def checkpoint_body(tmp: LockedTempFile, max_leaves: int) -> Iterator[CheckpointBody]:
    """Fill the locked temporary file: the caller creates every object through the yielded body and
    sets its ``root``; on the way out, the root attributes, the structure digest, the space
    reservation, the header and an fsync."""
    body = CheckpointBody(tmp, max_leaves)
    try:
        yield body
        body._finish()
    except BaseException:
        _close_quietly(body.file)
        raise
    close_written(body.file)
    write_header(tmp.path, body.ub_size, body.raw.ranges)
    os.fsync(tmp.fd)


def _close_quietly(f: h5py.File) -> None:
    """Close after a failure; a second error from HDF5 here would only hide the first one."""
    with contextlib.suppress(Exception):
        close_written(f)


def write_error(path: Path, tmp: Path, exc: BaseException) -> CheckpointWriteError:
    """A CheckpointWriteError for an OS/HDF5 failure while saving ``path`` (errno kept where known)."""
    number = exc.errno if isinstance(exc, OSError) and exc.errno else None
    if number is None and (found := _ERRNO_IN_TEXT.search(str(exc))):
        number = int(found[1])
    detail = " ".join(str(exc).split())
    detail = detail if len(detail) <= 240 else detail[:240] + "..."
    reason = _REASONS.get(number) or (f"{os.strerror(number)} (errno {number})" if number else detail)
    message = (
        f"cannot save {path}: {reason}, while writing the temporary file {tmp.name}; it was removed and "
        f"{path} was left as it was (detail: {type(exc).__name__}: {detail})"
    )
    return CheckpointWriteError(number, message, str(path))


def _is_io_error(exc: BaseException) -> bool:
    """OS errors, and HDF5's I/O failures (h5py raises some of them as RuntimeError)."""
    if isinstance(exc, CheckpointError):
        return False
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and bool(_ERRNO_IN_TEXT.search(str(exc))))


@contextlib.contextmanager
def atomic_file(path: Path, overwrite: bool) -> Iterator[LockedTempFile]:
    """A fresh locked temporary file next to ``path`` for the caller to fill; published as ``path`` when
    the ``with`` block ends without an error (the commit).

    Any failure removes the temporary file and leaves ``path`` as it was; OS and HDF5 I/O failures
    (a full disk, a file size limit) are raised as :class:`CheckpointWriteError`.
    """
    remove_stale_temp_files(path.parent)
    tmp_name = temp_path(path)
    try:
        with LockedTempFile(tmp_name) as tmp:
            yield tmp
            tmp.unlock()
            publish(tmp.path, path, overwrite)
            tmp.keep()
    except BaseException as exc:
        if _is_io_error(exc):
            raise write_error(path, tmp_name, exc) from exc
        raise
