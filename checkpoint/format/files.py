"""The file rules every writer of the package follows, spelled once: temporary names, the pid check,
fsync, atomic publish, and the target check.

Writers of checkpoint files (``_atomic``), manifests (``sets``), CLI outputs (``cli``) and storage
locations (``io``) all

1. check the target once before anything is written (:func:`check_target`: not a directory, the folder
   created if missing, no existing file unless ``overwrite``);
2. write a hidden temporary file next to it named after the writer (:func:`temp_name` / :func:`temp_path`:
   ``.<name>.tmp-<host>.<pid>-<8 hex>``), so a later save can tell a killed writer's leftover from a live
   one's (:func:`pid_alive`);
3. fsync it (:func:`fsync_path`) and give it its final name in one atomic step (:func:`publish`), then
   fsync the folder.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointExistsError

__all__ = [
    "REMOTE_GRACE_S",
    "TEMP_RE",
    "check_target",
    "fsync_path",
    "host_tag",
    "pid_alive",
    "publish",
    "temp_name",
    "temp_path",
]

TEMP_RE = re.compile(r"^\.(?P<target>.+)\.tmp-(?:(?P<host>[A-Za-z0-9_.-]+)\.)?(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})$")
REMOTE_GRACE_S = 600.0  # a temporary file of another host is a leftover once it has not changed for this long


@functools.cache
def host_tag() -> str:
    """This host's name as a file-name part: letters, digits, '-' and '_' only (dots become '_')."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64]
    return name or "localhost"


def temp_name(name: str) -> str:
    """The hidden temporary name a file is written under before it is published as ``name``:
    ``.<name>.tmp-<host>.<pid>-<8 hex>`` (a later save removes it if its writer was killed)."""
    return f".{name}.tmp-{host_tag()}.{os.getpid()}-{secrets.token_hex(4)}"


def temp_path(path: Path) -> Path:
    """A fresh temporary path next to ``path`` for this process (see :func:`temp_name`)."""
    return path.with_name(temp_name(path.name))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host may still be running.

    Only a process that certainly does not exist (``ProcessLookupError``) counts as gone: a process we
    may not signal (``PermissionError``: another user's) is alive, and so is any other error, because a
    wrong "gone" would delete a live writer's file.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError included: alive, owned by someone else
        return True
    return True


def fsync_path(path: Path, flags: int) -> None:
    """fsync the file (or, with ``O_DIRECTORY``, the folder) at ``path``."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Give the finished temp file its final name atomically; refuse to replace unless asked."""
    if overwrite:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path)  # atomic "create if absent": closes the race with a concurrent writer
        except FileExistsError:
            raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it") from None
        except OSError:  # file system without hard links
            if path.exists():
                raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it") from None
            os.replace(tmp, path)
        else:
            os.unlink(tmp)
    try:
        fsync_path(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename itself is still atomic


def check_target(
    display: str,
    *,
    is_dir: Callable[[], bool],
    make_parent: Callable[[], None],
    exists: Callable[[], bool],
    overwrite: bool,
) -> None:
    """Refuse a directory or an existing file without ``overwrite``; create a missing folder (as DCP does).

    The target is given by its checks (a local path's or a storage location's), so local and remote
    saves refuse with the same words.
    """
    if is_dir():
        raise IsADirectoryError(f"{display} is a directory; give a file path for the checkpoint")
    make_parent()
    if not overwrite and exists():
        raise CheckpointExistsError(f"{display} already exists; pass overwrite=True to replace it")
