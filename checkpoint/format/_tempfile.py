"""The temporary file of a save: named after its writer, locked while it lives, cleaned up when it is stale.

A save writes ``.<name>.tmp-<host>.<pid>-<8 hex>`` next to the target and holds an exclusive ``flock``
on it from its creation until just before it is published (or until it is removed). A killed save
leaves its file behind;
:func:`remove_stale_temp_files` (called by every save for its folder, and by ``cleanup_temp_files``)
removes such a file only when

* no process holds its lock (a live writer always does; the lock dies with its process), and
* its writer is gone: on this host its pid is not alive; from another host (the folder is shared) it
  has not been modified for ``REMOTE_GRACE_S`` (a live writer keeps writing; and a file system whose
  locks are not shared between hosts must not let us delete another host's live file).

Names of the older form ``.<name>.tmp-<pid>-<8 hex>`` (no host; also used for manifests and CLI outputs,
written without a lock) are treated as this host's. Other files are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from pathlib import Path

from .files import REMOTE_GRACE_S, TEMP_RE, host_tag, pid_alive

__all__ = ["LockedTempFile", "remove_stale_temp_files"]


class LockedTempFile:
    """Create ``path`` exclusively and hold an ``flock`` on it; the context removes it unless :meth:`keep`.

    ``fd`` is open read-write for the raw writes of the save (HDF5 opens the file separately).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._keep = False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: the pid in the name still protects the file
            pass

    def unlock(self) -> None:
        """Release the lock just before the file is published: readers of the published file must never
        meet it (nor a copy of it held by a child forked meanwhile: ``flock`` locks are shared by every
        descriptor of the open file, and this releases them all). A live writer's file stays safe from
        cleanup by its name (its pid is alive)."""
        if self.fd >= 0:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except OSError:
                pass

    def keep(self) -> None:
        """The file was published under its final name (the temporary name is gone): do not remove it."""
        self._keep = True

    def discard(self) -> None:
        """Remove the temporary file (while still holding its lock) and close it."""
        self._keep = False
        self.close()

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if not self._keep:
                self.path.unlink(missing_ok=True)
        finally:
            fd, self.fd = self.fd, -1
            os.close(fd)  # releases the lock

    def __enter__(self) -> LockedTempFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _writer_gone(match: re.Match, mtime: float, now: float) -> bool:
    host = match["host"]
    if host is None or host == host_tag():
        return not pid_alive(int(match["pid"]))
    return now - mtime >= REMOTE_GRACE_S


def _open_for_lock(path: Path) -> int | None:
    """Open read-write where possible: NFS emulates flock with fcntl locks, whose exclusive kind needs it."""
    flags = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for mode in (os.O_RDWR, os.O_RDONLY):
        try:
            return os.open(path, mode | flags)
        except PermissionError:
            continue
        except OSError:
            return None
    return None


def _remove_if_unlocked(path: Path) -> bool:
    """Take the file's lock without waiting; if no one holds it, remove the file (still locked).

    Where the file system has no locks at all, the writer checks of the caller decide alone.
    """
    fd = _open_for_lock(path)
    if fd is None:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False  # a live writer holds it
        if not os.path.samestat(os.fstat(fd), os.lstat(path)):
            return False  # replaced meanwhile
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_stale_temp_files(folder: Path, *, older_than_s: float = 0.0) -> list[Path]:
    """Remove the temporary files in ``folder`` that no live writer owns (see the module docstring).

    ``older_than_s`` additionally spares files modified within that many seconds. Never raises for a
    file it cannot inspect or remove (another process may be cleaning up at the same time).
    """
    now, removed = time.time(), []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        match = TEMP_RE.match(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_file(follow_symlinks=False) or now - st.st_mtime < older_than_s:
            continue
        if _writer_gone(match, st.st_mtime, now) and _remove_if_unlocked(Path(entry.path)):
            removed.append(Path(entry.path))
    return sorted(removed)
