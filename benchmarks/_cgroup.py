"""Run a benchmark child under a memory limit: a Linux memory cgroup (v2, or v1's memory controller).

"Does GPT-2 of this size train in N GiB?" is answered by running it with N GiB and no more: the
kernel's OOM killer ends the child (and only the child) when its memory passes the limit, which
`benchmarks/memory.py --limit-gib` reports as "does not fit". Creating a cgroup needs write access to
the cgroup file system (root in a container or VM); without it the benchmark stops with a clear message
instead of running unlimited.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _new_group(name: str, limit_bytes: int) -> tuple[Path, Path]:
    """(the group's folder, its cgroup.procs): v2 when the unified hierarchy has the memory controller."""
    if (_ROOT / "cgroup.controllers").exists() and "memory" in (_ROOT / "cgroup.controllers").read_text().split():
        group, limit_file = _ROOT / name, "memory.max"
    elif (_ROOT / "memory").is_dir():
        group, limit_file = _ROOT / "memory" / name, "memory.limit_in_bytes"
    else:
        raise SystemExit(f"--limit-gib: no memory cgroup controller under {_ROOT} on this host")
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_bytes))
        if limit_file == "memory.max":
            (group / "memory.swap.max").write_text("0")  # a limit counts RAM: no swapping past it
    except OSError as error:
        with contextlib.suppress(OSError):
            group.rmdir()
        raise SystemExit(f"--limit-gib: cannot create the memory cgroup {group} ({error}); run as root") from error
    return group, group / "cgroup.procs"


@contextlib.contextmanager
def memory_limit(gib: float | None) -> Iterator[Callable[[], None] | None]:
    """A ``preexec_fn`` that moves the child into a fresh cgroup limited to ``gib`` GiB (None: no limit).

    The group is removed when the block ends (after the child has exited).
    """
    if not gib:
        yield None
        return
    group, procs = _new_group(f"ort_trainer_bench_{os.getpid()}", int(gib * 1024**3))

    def enter() -> None:
        procs.write_text(str(os.getpid()))

    try:
        yield enter
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
