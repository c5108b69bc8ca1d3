"""SIGKILL one rank at a random moment of a distributed save (sync and async) and of a single-process async save.

The previous complete checkpoint must always stay loadable, and nothing half-published may be visible:
whatever manifest (or single file) is at the path verifies completely and holds one step of the run,
never older than one seen before. Each round forks fresh savers from helpers that imported the library
once (tests/checkpoint/kill_saver.py); after the victim is killed the other rank is killed too (its job is gone).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ort_trainer import checkpoint
from tests.ranks import free_port

pytestmark = [pytest.mark.faults, pytest.mark.processes]  # SIGKILL loops: part of `make test-faults`

REPO = Path(__file__).resolve().parents[2]
KILLS = 12  # random kill moments per test (each round 5-10 s: a fresh trainer, a save, a kill, a full verify)


class _Helper:
    """One rank's helper process (tests.checkpoint.kill_saver) and the lines it and its children print."""

    def __init__(self, rank: int, world: int, path: Path, mode: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "tests.checkpoint.kill_saver", str(rank), str(world), str(path), mode]
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pending: list[str] = []
        assert self.expect("ready") == ""

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str) -> str:
        for i, line in enumerate(self.pending):
            if line.startswith(prefix):
                return self.pending.pop(i)[len(prefix) :].strip()
        while True:
            line = self.proc.stdout.readline()
            assert line, f"helper exited (code {self.proc.poll()})"
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            self.pending.append(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _loaded_step(path: Path, world: int) -> int | None:
    """The step of the checkpoint visible at ``path`` (None if there is none yet), verified completely."""
    if world == 1:
        if not path.exists():
            return None
        state = checkpoint.load(path)  # every checksum
        return state["train_step_info"]["step"]
    manifest = checkpoint.manifest_path(path)
    if not manifest.exists():
        return None
    checked = checkpoint.check_manifest(manifest)  # every file present, sizes and CRC-32s as published
    full = checkpoint.aggregate_checkpoints(manifest)
    assert checked.step == full["train_step_info"]["step"]
    return checked.step


def _kill_rounds(tmp_path: Path, world: int, mode: str, seed: int) -> None:
    path = tmp_path / "set.ortcp"
    helpers = [_Helper(rank, world, path, mode) for rank in range(world)]
    watchdog = threading.Timer(600, lambda: [h.proc.kill() for h in helpers])
    watchdog.start()
    rng, seen, advanced = random.Random(seed), None, 0
    try:
        for _ in range(KILLS):
            port = free_port()
            for h in helpers:
                h.send(f"go {port}")
            pids = [int(h.expect("pid")) for h in helpers]
            for h in helpers:
                h.expect("saved")
            victim = rng.randrange(world)
            threading.Event().wait(rng.uniform(0.0, 0.4))
            os.kill(pids[victim], signal.SIGKILL)
            threading.Event().wait(rng.uniform(0.0, 0.05))
            for pid in pids:  # the job is gone: the other ranks are killed too
                os.kill(pid, signal.SIGKILL)
            for rank, (h, pid) in enumerate(zip(helpers, pids, strict=True)):
                h.send(f"reap {pid}")
                status = int(h.expect("status"))
                killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                # a survivor may notice its peer's death first (gloo: connection reset) and fail: exit code 3
                assert killed or (rank != victim and os.WEXITSTATUS(status) == 3), f"rank {rank} saver: {status}"
            step = _loaded_step(path, world)
            assert step is not None, "a first save completed, yet no checkpoint is visible"
            assert seen is None or step >= seen, f"checkpoint went back from step {seen} to {step}"
            advanced += seen is not None and step > seen
            seen = step
    finally:
        watchdog.cancel()
        for h in helpers:
            h.close()
    assert advanced > 0, "no save completed between kills"
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    if world > 1:  # files of killed saves and of replaced sets were removed by later saves (the last kill's stay)
        manifest = checkpoint.read_manifest(checkpoint.manifest_path(path))
        extra = set(visible) - {manifest.path.name, *(e.name for e in manifest.files)}
        assert len(extra) <= world and all(re.fullmatch(r"set\.rank\d-of-2\.[0-9a-f]{8}\.ortcp", n) for n in extra), (
            visible
        )
    else:
        assert visible == [path.name], visible
    hidden = len(list(tmp_path.glob(".*")))  # temporary files of killed writers
    print(f"{KILLS} kills ({world} ranks, {mode}): {advanced} rounds advanced; {hidden} temporary files left")


def test_sigkill_of_one_rank_during_distributed_saves_keeps_the_previous_set(tmp_path):
    """issue 12.5: overwriting a set in place lost both the old and the new set when a rank died mid-save."""
    _kill_rounds(tmp_path, 2, "sync", seed=1205)


def test_sigkill_during_async_distributed_saves_keeps_the_previous_set(tmp_path):
    _kill_rounds(tmp_path, 2, "async", seed=1301)


def test_sigkill_during_async_single_process_saves_keeps_the_previous_checkpoint(tmp_path):
    _kill_rounds(tmp_path, 1, "async", seed=1302)
