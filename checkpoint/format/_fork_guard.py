"""A process forked during a save must never write into the file that save publishes.

The writer keeps its HDF5 file open while it fills it, and the temporary file it writes is the very
inode that is published (renamed) afterwards. A child forked meanwhile (a ``multiprocessing`` or
DataLoader worker, an ``os.fork`` helper) inherits HDF5's in-memory state of that file and its
descriptors. When the child later closes it (HDF5 closes every open file at exit; and opening the
same checkpoint in the child shares HDF5's open file for that inode), HDF5 flushes its stale metadata
into the published checkpoint and damages it, after the parent has already waited for the save and
loaded it.

Every file a save writes is created and closed through :func:`open_for_write` / :func:`close_written`,
which keep it in a registry. At fork, in the child only (``os.register_at_fork``):

1. each descriptor of a registered file (HDF5's own and the raw writer's) is pointed at a private
   anonymous scratch file (``dup2``): whatever the child's HDF5 writes from now on goes there;
2. the inherited HDF5 file is closed in the child, so its HDF5 forgets it: a checkpoint the child
   opens later is read from disk.

HDF5's state is consistent at that point: h5py holds its global lock (``phil``) across ``fork``, so no
HDF5 call is half done. Creating a file and registering it (closing it and forgetting it) happen under
this module's lock, which the fork also takes first, so a child never inherits an open file that is
not in the registry, nor a stale descriptor number that was meanwhile given to another file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable

import h5py  # imported first: its own fork handlers (phil) must be registered before ours

__all__ = ["close_written", "open_for_write"]

logger = logging.getLogger("ort_trainer")

_lock = threading.Lock()
_writing: dict[int, tuple[h5py.File, tuple[int, ...]]] = {}  # id(file) -> (file, its descriptors)
_abandoned: list[h5py.File] = []  # in a child: inherited files that could not be detached, never closed


def open_for_write(create: Callable[[], h5py.File], extra_fds: Iterable[int] = ()) -> h5py.File:
    """``create()`` the HDF5 file a save writes and register it (with ``extra_fds``, other descriptors
    of the same file) so that a process forked while it is open never writes into it."""
    with _lock:
        f = create()
        _writing[id(f)] = (f, (*_vfd_handles(f), *extra_fds))
    return f


def close_written(f: h5py.File) -> None:
    """Close a file opened by :func:`open_for_write` and forget it (also when closing fails)."""
    with _lock:
        try:
            f.close()
        finally:
            _writing.pop(id(f), None)


def _vfd_handles(f: h5py.File) -> tuple[int, ...]:
    """HDF5's descriptor of ``f`` (the sec2 driver's ``int``); none for a driver without one."""
    handle = f.id.get_vfd_handle()
    return (handle,) if isinstance(handle, int) and handle >= 0 else ()


def _scratch_fd() -> int:
    """A private writable file for a child's inherited HDF5 writes: anonymous memory, else an unlinked
    temporary file, else ``/dev/null``."""
    if hasattr(os, "memfd_create"):
        with contextlib.suppress(OSError):
            return os.memfd_create("ort_trainer-fork-scratch", getattr(os, "MFD_CLOEXEC", 0))
    with contextlib.suppress(OSError):
        fd, name = tempfile.mkstemp(prefix="ort_trainer-fork-scratch-")
        os.unlink(name)
        return fd
    return os.open(os.devnull, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))


def _before_fork() -> None:
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()


def _after_fork_in_child() -> None:
    """Detach every inherited file of a save from the published inode, then close it (see module docstring)."""
    entries = list(_writing.values())
    _writing.clear()
    _lock.release()
    for f, fds in entries:
        try:
            scratch = _scratch_fd()
            try:
                for fd in fds:
                    os.dup2(scratch, fd, inheritable=False)
            finally:
                os.close(scratch)
        except OSError as exc:  # no scratch file at all: cut the descriptors; never let HDF5 close the file
            logger.error("a process forked during a checkpoint save could not detach from its file: %s", exc)
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _abandoned.append(f)
            continue
        try:
            f.close()  # flushes into the scratch file; the child's HDF5 forgets the file
        except Exception as exc:  # the file's state belongs to the parent; the child only needs it gone
            logger.debug("closing a checkpoint inherited from a save in a forked child: %s", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
