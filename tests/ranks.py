"""Launching local ranks for the distributed tests: a free port on 127.0.0.1 and one process per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.paths import REPO

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a local server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, argv: list[str], timeout_s: float = 240) -> list[str]:
    """Run ``python <argv>`` as ``world`` ranks (RANK/WORLD_SIZE/MASTER_* set, gloo on 127.0.0.1).

    Returns each rank's output. Fails the test, with the tail of every failed rank's log, when a rank
    exits non-zero; kills every rank still running on a failure or a timeout, so nothing is left behind.
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        out = subprocess.PIPE
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        logs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [
        (r, p.returncode, log[-3000:]) for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if p.returncode
    ]
    assert not failed, f"ranks failed: {failed}"
    return logs
