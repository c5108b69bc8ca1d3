"""Run damaged-file cases in child processes that may crash or hang without taking the test down.

``run_cases(source, cases, scratch)`` damages ``source`` per case (``["truncate", offset]``: cut the
file there; ``["flip", offset]``: invert that byte; ``["bit", offset]``: flip one bit of it), then loads
it and verifies it, in two child processes (one per core). Each case reports ``same`` (the load gave
the original data exactly), ``error:<CheckpointError subclass>``, or anything else; ``verify`` must
agree with ``load``. A child that dies or stops answering for ``CASE_SECONDS`` gets the case recorded
as ``CRASH``/``HANG`` and is restarted on the cases after it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.paths import REPO

__all__ = ["CASE_SECONDS", "run_cases"]

CASE_SECONDS = 30.0
RUNNER = r"""
import json, sys, torch
from ort_trainer import checkpoint as C
src, out = sys.argv[1], sys.argv[2]
original = open(src, "rb").read()
reference = C.load(src)

def same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))
    return type(a) is type(b) and a == b

def outcome(fn):
    try:
        return "same" if fn() else "DIFFERENT DATA"
    except C.CheckpointError as exc:
        return "error:" + type(exc).__name__
    except BaseException as exc:
        return f"WRONG EXCEPTION {type(exc).__name__}: {str(exc)[:300]}"

def verified():
    with C.open_checkpoint(out) as reader:
        reader.verify()
    return True

print(json.dumps(["ready"]), flush=True)
for line in sys.stdin:
    kind, offset = json.loads(line)
    data = bytearray(original)
    if kind == "truncate":
        del data[offset:]
    else:
        data[offset] ^= 0xFF if kind == "flip" else 1 << (offset % 8)
    with open(out, "wb") as f:
        f.write(data)
    print(json.dumps([kind, offset, outcome(lambda: same(reference, C.load(out))), outcome(verified)]), flush=True)
"""


class _Worker:
    """One child process working through a list of cases, restarted after a crash or a hang."""

    def __init__(self, source: Path, scratch: Path) -> None:
        self.source, self.scratch, self.proc, self.buffer = source, scratch, None, b""

    def _start(self) -> None:
        args = [sys.executable, "-c", RUNNER, str(self.source), str(self.scratch)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
        self.buffer = b""
        assert self._line(120.0) == ["ready"], "the fuzz runner did not start"

    def _line(self, timeout: float) -> list | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def run(self, cases: list, results: list) -> None:
        for kind, offset in cases:
            if self.proc is None:
                self._start()
            self.proc.stdin.write((json.dumps([kind, offset]) + "\n").encode())
            self.proc.stdin.flush()
            answer = self._line(CASE_SECONDS)
            if answer is None:
                self.proc.kill()
                status = self.proc.wait()
                what = "HANG" if status == -9 else f"CRASH (exit status {status})"
                results.append([kind, offset, what, what])
                self.proc = None
            else:
                results.append(answer)
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def run_cases(source: Path, cases: list, scratch: Path) -> list:
    """Results ``[kind, offset, load outcome, verify outcome]`` of every case, in no particular order."""
    results: list = []
    workers = [_Worker(source, scratch / f"case{i}.ortcp") for i in range(2)]
    threads = [threading.Thread(target=w.run, args=(cases[i::2], results)) for i, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
