"""Two torchrun agents on 127.0.0.1 (``--nnodes 2 --nproc_per_node 1 --rdzv-backend c10d``), for the elastic tests.

Agent A starts first and hosts the c10d rendezvous store (the rendezvous leader); agent B joins. Each
agent's workers see ``ELASTIC_NODE=A`` or ``B``. Every run has a hard timeout, after which the workers
(each in a session of its own: torchrun starts them so) print their stacks and are killed, then both
agents' process groups, so nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO
from tests.ranks import free_port

__all__ = ["AgentRun", "run_agents"]


@dataclass
class AgentRun:
    returncodes: dict[str, int | None]  # None: killed at the timeout
    logs: dict[str, str]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes.values())

    def tail(self, chars: int = 4000) -> str:
        return "\n".join(f"--- agent {n} (rc={self.returncodes[n]}):\n{log[-chars:]}" for n, log in self.logs.items())


def _wait_listening(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def run_agents(argv: list[str], logdir: Path, *, timeout_s: float = 120, max_restarts: int = 2, env=None) -> AgentRun:
    """``torchrun ... <argv>`` as two agents; returns their exit codes and logs (never raises on failure)."""
    logdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
    base.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"elastic{port}"]
    command += ["--max-restarts", str(max_restarts), "--local-addr", "127.0.0.1", *argv]
    start = time.monotonic()
    deadline = start + timeout_s
    procs, files = {}, {}
    try:
        for node in ("A", "B"):
            files[node] = open(logdir / f"agent{node}.log", "wb")
            procs[node] = subprocess.Popen(
                command,
                cwd=REPO,
                env={**base, "ELASTIC_NODE": node},
                stdout=files[node],
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the agent and its workers are killed together
            )
            if node == "A":
                _wait_listening(port, min(deadline, time.monotonic() + 30))  # A hosts the rendezvous store
        for proc in procs.values():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        alive = [proc for proc in procs.values() if proc.poll() is None]
        if alive:
            workers = [pid for proc in alive for pid in _descendants(proc.pid)]
            _signal(workers, signal.SIGUSR1)  # the workers print their threads' stacks into the logs
            time.sleep(1.0)
            _signal(workers, signal.SIGKILL)  # torchrun starts each worker in a session of its own
            for proc in alive:
                _kill_group(proc)
        for f in files.values():
            f.close()
    seconds = time.monotonic() - start
    returncodes = {n: p.returncode if p.returncode >= 0 else None for n, p in procs.items()}
    logs = {n: (logdir / f"agent{n}.log").read_text(errors="replace") for n in procs}
    return AgentRun(returncodes, logs, seconds)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
