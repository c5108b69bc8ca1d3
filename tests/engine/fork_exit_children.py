"""Forked children that train and then exit normally, for tests/engine/test_fork_exit.py (issue S5, item 7).

``python -m tests.engine.fork_exit_children OUT`` trains an ``ORTTrainer`` one step (its sessions, their
thread pools and ONNX Runtime's own background threads exist in the parent), then forks children that each
do some work and leave the way a normal program does, never through ``os._exit``:

* ``trainer-sys-exit``: builds its own trainer, trains three steps, saves a checkpoint, writes a text file it
  never closes and an HDF5 file Python never frees (a leaked reference), prints without flushing, and
  calls ``sys.exit(0)``;
* ``trainer-falls-off``: the same, and returns to the end of this module (exit status 0);
* ``exit-code``: writes the file and prints (no training: the import alone made the exit hang) and calls
  ``sys.exit(5)``: the parent must see 5;
* ``ortmodule``: trains an ``ORTModule`` three steps and calls ``sys.exit(0)``;
* ``mp-fork``: a ``multiprocessing`` worker (fork start method) that trains, writes the text file and returns
  from its target (no HDF5 file: multiprocessing ends a worker with ``os._exit``, which closes nothing).

The children get ``DEADLINE`` seconds together; one still running then is killed and reported as hung. Prints one JSON
line: per child its exit code (or ``"hung"``) and its captured stdout.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import h5py
import torch

from ort_trainer import ORTModule
from tests.builders import mlp_trainer
from tests.models import MLP, mlp_batches

DEADLINE = 60.0
KINDS = ("trainer-sys-exit", "trainer-falls-off", "exit-code", "ortmodule")


def _train_a_trainer(out: Path, kind: str, train: bool = True) -> None:
    """Train a fresh trainer three steps and save it (``train``), and leave a file and stdout for the exit to
    flush."""
    losses = []
    if train:
        trainer = mlp_trainer()
        losses = [float(trainer.train_step(*batch)) for batch in mlp_batches(3)]
        trainer.save_checkpoint(out / f"{kind}.ortcp")
    unclosed = open(out / f"{kind}.txt", "w")  # noqa: SIM115 -- the exit must flush and close it
    unclosed.write(f"{kind} wrote this\n")
    if kind != "mp-fork":  # multiprocessing ends its workers with os._exit: nothing closes HDF5 there
        leaked = h5py.File(out / f"{kind}.h5", "w")
        leaked["steps"] = list(range(len(losses)))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(leaked))  # never freed by Python: only HDF5's close at exit
    print(f"{kind} losses {losses}")  # stdout is a pipe: block-buffered, flushed only by the exit


def _train_an_ortmodule() -> None:
    torch.manual_seed(0)
    module = ORTModule(MLP())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for inputs, label in mlp_batches(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(inputs), label).backward()
        opt.step()
    print("ortmodule trained")


def _single_threaded_torch() -> None:
    """A torch built with GNU OpenMP (the onnxruntime-training venv's) hangs in a forked child that runs a parallel
    op after the parent did (libgomp is not fork-safe; not ONNX Runtime's exit): children use one thread, as
    DataLoader workers do."""
    torch.set_num_threads(1)


def _mp_target(out: str) -> None:
    _single_threaded_torch()
    _train_a_trainer(Path(out), "mp-fork")


def _wait(pid: int, deadline: float) -> int | str:
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


def _fork(kind: str, out: Path) -> tuple[int, int]:
    """Fork a child of ``kind`` with its stdout on a pipe; returns (pid, read end). The child never returns
    from here except ``trainer-falls-off``, which returns ``(0, -1)``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    os.close(read)
    _single_threaded_torch()
    os.dup2(write, 1)
    os.close(write)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 -- a fresh block-buffered stream on the pipe
    if kind == "ortmodule":
        _train_an_ortmodule()
        sys.exit(0)
    _train_a_trainer(out, kind, train=kind != "exit-code")
    if kind == "exit-code":
        sys.exit(5)
    if kind == "trainer-sys-exit":
        sys.exit(0)
    return 0, -1  # trainer-falls-off: back to the end of the module


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def main() -> bool:
    """Returns True in the parent (which prints the report), False in a child that falls off the end."""
    out = Path(sys.argv[1])
    parent = mlp_trainer()
    parent.train_step(*mlp_batches(1)[0])
    children = {}
    for kind in KINDS:
        pid, read = _fork(kind, out)
        if pid == 0:
            return False
        children[kind] = (pid, read)
    worker = multiprocessing.get_context("fork").Process(target=_mp_target, args=(str(out),))
    worker.start()
    report, deadline = {}, time.monotonic() + DEADLINE  # one deadline for all: a hang costs DEADLINE once
    for kind, (pid, read) in children.items():
        code = _wait(pid, deadline)
        report[kind] = {"code": code, "stdout": _read_all(read)}
    worker.join(max(deadline - time.monotonic(), 1.0))
    if worker.is_alive():
        worker.kill()
        worker.join()
        report["mp-fork"] = {"code": "hung"}
    else:
        report["mp-fork"] = {"code": worker.exitcode}
    parent.train_step(*mlp_batches(2)[1])  # the parent still trains after its children exited
    print(json.dumps(report), flush=True)
    return True


if __name__ == "__main__":
    main()
