"""Crafted files against every reader: each one refuses each case with a CheckpointError, quickly, in bounded memory.

The cases (``tests/checkpoint/crafted_files.py``) have valid checksums: only validation can catch them. Every case
runs in a process of its own, forked from a helper that imported the library once, under a memory
limit (``RLIMIT_AS``: the helper's address space after imports plus ``MEMORY_MARGIN``) and a time limit
(``CASE_SECONDS`` for all readers together): an allocation of the declared size, a hang or a crash fails
the case and names the reader it happened in. Readers: ``load``; ``open_checkpoint`` + ``walk`` +
``read``/``read_into``; ``verify``; ``aggregate_checkpoints``; ``aggregate_to_file``; the CLI's
``inspect``, ``verify``, ``diff``, ``convert``, ``aggregate``; ``ORTTrainer.load_checkpoint``.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from ort_trainer import checkpoint as C
from tests.checkpoint.crafted_files import ACCEPTED, CASES, base_tree, build
from tests.paths import REPO

READERS = (
    "load",
    "walk_read",
    "verify",
    "aggregate",
    "aggregate_to_file",
    "cli_inspect",
    "cli_verify",
    "cli_diff",
    "cli_convert",
    "cli_aggregate",
    "trainer_load",
)
# Address space a case may add to the helper's (its VmSize after importing torch, ~0.75 GB). Measured:
# the sound files pass every reader with 16 MiB; 256 MiB leaves room and still stops an allocation of a
# crafted declared size (the 1 GiB bomb, the 4 TiB datasets) with a MemoryError, which fails the case.
MEMORY_MARGIN = 256 << 20
CASE_SECONDS = 60.0  # all readers of one case together (a valid file takes ~2 s on a loaded 2-core machine)

HELPER = r"""
import contextlib, io, json, os, resource, sys, time
import torch
from ort_trainer import ORTTrainer, optim
from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.cli._main import main as cli
from tests.checkpoint.crafted_files import base_tree

def trainer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    desc = {"inputs": [("x", ["batch", 4]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    return ORTTrainer(model, desc, optim.AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)

def walk_read(path, tmp):
    with C.open_checkpoint(path) as reader:
        for key, info in reader.walk():
            if isinstance(info.dtype, torch.dtype):
                reader.read_into(key, torch.empty(info.shape, dtype=info.dtype))
            reader.read(key)

def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli([str(a) for a in argv])
    return ["cli", code, (err.getvalue() + out.getvalue())[-1500:]]

READERS = {
    "load": lambda p, t: C.load(p),
    "walk_read": walk_read,
    "verify": lambda p, t: C.open_checkpoint(p).verify(),
    "aggregate": lambda p, t: C.aggregate_checkpoints(p),
    "aggregate_to_file": lambda p, t: C.aggregate_to_file(p, t / "agg.ortcp", overwrite=True),
    "cli_inspect": lambda p, t: run_cli("inspect", p),
    "cli_verify": lambda p, t: run_cli("verify", p),
    "cli_diff": lambda p, t: run_cli("diff", p, t / "base.ortcp"),
    "cli_convert": lambda p, t: run_cli("convert", p, "-o", t / "out.pt", "--overwrite"),
    "cli_aggregate": lambda p, t: run_cli("aggregate", p, "-o", t / "agg2.ortcp", "--overwrite"),
    "trainer_load": lambda p, t: trainer().load_checkpoint(p),
}

def emit(item):
    os.write(1, (json.dumps(item)[:3000] + "\n").encode())

def run_case(path, tmp, margin):
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + margin, vm + margin))
    C.save(base_tree(), tmp / "base.ortcp", overwrite=True)
    for name, reader in READERS.items():
        emit([name, "start"])
        t0 = time.perf_counter()
        try:
            result = reader(path, tmp)
            emit([name] + (result if isinstance(result, list) else ["ok", repr(type(result))]))
        except C.CheckpointError as exc:
            emit([name, "error", type(exc).__name__, str(exc)])
        except BaseException as exc:
            emit([name, "WRONG", type(exc).__name__, str(exc)])
        emit([name, "time", time.perf_counter() - t0])
    emit(["done"])

from pathlib import Path
# The first ORTTrainer of a process imports the engine's modules (~850 of them, seconds each time): built once
# here, so that every forked case inherits them and spends its time in the readers (it still builds its own).
trainer()
emit(["ready"])
for line in sys.stdin:
    path, tmp, margin = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            run_case(Path(path), Path(tmp), margin)
        finally:
            os._exit(0)
    emit(["pid", pid])
    emit(["exit", os.waitpid(pid, 0)[1]])
"""


class _Helper:
    """The fork server: one request per case, answered by JSON lines on its stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
        )
        self.buffer = b""
        self.times: dict[str, float] = {}  # seconds spent in each reader, over all cases
        assert self._line(120) == ["ready"]

    def _line(self, timeout: float) -> list | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            assert chunk, "the helper process died"
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def run(self, path, tmp) -> tuple[dict, str]:
        """{reader: outcome} and how the case's process ended ('done', 'timeout in X', 'crash ...')."""
        self.proc.stdin.write((json.dumps([str(path), str(tmp), MEMORY_MARGIN]) + "\n").encode())
        self.proc.stdin.flush()
        deadline, results, current, pid, end = time.monotonic() + CASE_SECONDS, {}, None, None, None
        while True:
            item = self._line(max(0.0, deadline - time.monotonic()) if end is None else 60.0)
            if item is None:
                assert end is None and pid is not None, f"the helper stopped answering ({end})"
                os.kill(pid, signal.SIGKILL)  # the helper reaps it and reports its exit
                end = f"timeout after {CASE_SECONDS:.0f} s in reader {current}"
                continue
            if item[0] == "pid":
                pid = item[1]
            elif item[0] == "exit":
                status = item[1]
                if end is None and not (os.WIFEXITED(status) and "done" in results):
                    end = f"process died ({status}) in reader {current}"
                return results, end or "done"
            elif item[0] == "done":
                results["done"] = True
            elif item[1] == "start":
                current = item[0]
            elif item[1] == "time":
                self.times[item[0]] = self.times.get(item[0], 0.0) + item[2]
            else:
                results[item[0]] = item[1:]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def helper():
    h = _Helper()
    yield h
    h.close()
    print("seconds per reader, all cases:", {k: round(v, 2) for k, v in sorted(h.times.items())})


def _bad_outcomes(results: dict, pattern: str, filename: str, refusers: frozenset | None) -> list[str]:
    bad = []
    for reader, outcome in results.items():
        if reader == "done" or (refusers is not None and reader not in refusers):
            continue
        if outcome[0] == "cli":
            code, text = outcome[1], outcome[2]
            good = code in (1, 2) and re.search(pattern, text) and "Traceback" not in text
            good = good and not re.search(r"error: (RuntimeError|MemoryError|ValueError|TypeError|OverflowError)", text)
        else:
            good = outcome[0] == "error" and re.search(pattern, outcome[2]) and filename in outcome[2]
        if not good:
            bad.append(f"{reader}: {outcome}")
    return bad


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_reader_refuses_the_crafted_file(case, helper, tmp_path):
    path = build(case, tmp_path / "case")
    start = time.monotonic()
    results, end = helper.run(path, tmp_path)
    elapsed = time.monotonic() - start
    assert end == "done", f"{case}: {end}; outcomes so far: {results}"
    _, pattern, refusers = CASES[case]
    bad = _bad_outcomes(results, pattern, path.name, refusers)
    assert not bad, f"{case} ({elapsed:.1f} s):\n" + "\n".join(bad)


@pytest.mark.parametrize("case", ["base", *sorted(ACCEPTED)])
def test_sound_files_pass_every_reader(case, helper, tmp_path):
    """The harness itself (the untouched base file), and sound layouts our writer does not use (compact,
    chunked without filters): every reader accepts them under the same limits."""
    if case == "base":
        path = tmp_path / "ok" / "crafted.ortcp"
        path.parent.mkdir()
        C.save(base_tree(), path)
    else:
        path = build(case, tmp_path / "case")
    results, end = helper.run(path, tmp_path)
    assert end == "done", results
    assert set(results) == {"done", *READERS}
    for reader, outcome in results.items():
        if reader != "done":
            assert outcome[0] == "ok" or (outcome[0] == "cli" and outcome[1] == 0), (reader, outcome)
