"""Forks during asynchronous saves, for tests/checkpoint/test_checkpoint_fork.py (issue 32, item 1).

``python -m tests.checkpoint.fork_saver OUT held`` trains an MLP one step and saves it asynchronously three times to
``OUT/a.ortcp`` (the second and third with ``overwrite=True``: no good copy is left if they are
damaged). Each save's writer thread is held at one phase while its HDF5 file is open (the first
dataset, halfway through the datasets, the end just before HDF5 closes the file), and the process
forks three children there: one that exits normally (``sys.exit``: HDF5's exit handler runs), one that
loads the checkpoint with ``os.fork`` and exits normally, and a ``multiprocessing`` (fork start method)
worker that loads it. Then the writer goes on; once the save is published the parent hashes the file
and loads it, and only then releases the children. After they are all gone it hashes and loads the
file again. ``python -m tests.checkpoint.fork_saver OUT free ROUNDS``: ROUNDS saves, each with up to 16 forks in a
loop while it runs (no phase held; children exit normally or load).

Prints one JSON line per phase: ``before``/``after`` are SHA-256 of the published file before the
children go on and after they exited, ``parent_before``/``parent`` the digest of the parent's load then
(or its error), and ``children`` what each loading child read (its digest or its error).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint.format import _atomic, _h5_writer
from tests.builders import mlp_trainer
from tests.models import mlp_batches


def _digest(tree: Any, h: Any = None) -> str:
    """One SHA-256 over every key and leaf of a loaded tree (tensors by their bytes)."""
    top = h is None
    h = h or hashlib.sha256()
    if isinstance(tree, dict):
        for key in sorted(tree):
            h.update(key.encode())
            _digest(tree[key], h)
    elif isinstance(tree, torch.Tensor):
        h.update(tree.contiguous().view(torch.uint8).numpy().tobytes() if tree.numel() else b"")
    else:
        h.update(repr(tree).encode())
    return h.hexdigest() if top else ""


def _load_digest(path: Path) -> str:
    try:
        return _digest(checkpoint.load(path))
    except Exception as exc:  # reported, not raised: the test names what failed
        return f"error {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Hold:
    """Holds the writer thread at one call (the n-th ``write_leaf``, or ``_reserve``) until released."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        self.leaf_index: int | None = None
        self.at_reserve = False
        self._count = 0
        real_leaf, real_reserve = _h5_writer.write_leaf, _atomic._reserve

        def write_leaf(*args: Any, **kwargs: Any) -> Any:
            if self.leaf_index is not None and self._count == self.leaf_index:
                self._wait()
            self._count += 1
            return real_leaf(*args, **kwargs)

        def reserve(*args: Any, **kwargs: Any) -> Any:
            if self.at_reserve:
                self._wait()
            return real_reserve(*args, **kwargs)

        _h5_writer.write_leaf, _atomic._reserve = write_leaf, reserve

    def arm(self, leaf_index: int | None, at_reserve: bool) -> None:
        self.reached.clear()
        self.release.clear()
        self.leaf_index, self.at_reserve, self._count = leaf_index, at_reserve, 0

    def _wait(self) -> None:
        self.reached.set()
        self.release.wait()


def _child(kind: str, gate: int, path: Path, report: Path) -> None:
    """In a forked child: wait for the parent to publish (the gate pipe closes), then load or just exit."""
    os.read(gate, 1)
    if kind != "exit":
        report.write_text(_load_digest(path))


def _mp_child(gate: int, gate_w: int, path: str, report: str) -> None:
    os.close(gate_w)  # inherited: the gate only opens once every copy of its write end is closed
    _child("mp-load", gate, Path(path), Path(report))


def _save_with_forks(trainer: Any, out: Path, phase: str, hold: _Hold, overwrite: bool) -> dict[str, Any]:
    path = out / "a.ortcp"
    gate_r, gate_w = os.pipe()
    handle = trainer.save_checkpoint(path, async_save=True, overwrite=overwrite)
    if not hold.reached.wait(60):
        raise RuntimeError(f"the writer never reached {phase}")
    pids, reports = [], {}
    for kind in ("exit", "load"):
        reports[kind] = out / f"{phase}-{kind}.txt"
        pid = os.fork()
        if pid == 0:
            os.close(gate_w)
            _child(kind, gate_r, path, reports[kind])
            sys.exit(0)  # a normal exit: atexit handlers run, HDF5's among them
        pids.append(pid)
    reports["mp-load"] = out / f"{phase}-mp-load.txt"
    worker = multiprocessing.get_context("fork").Process(
        target=_mp_child, args=(gate_r, gate_w, str(path), str(reports["mp-load"]))
    )
    worker.start()
    hold.release.set()
    handle.wait()
    before = _sha(path)
    parent_before = _load_digest(path)
    os.close(gate_w)  # the children go on now
    for pid in pids:
        os.waitpid(pid, 0)
    worker.join()
    os.close(gate_r)
    after = _sha(path)
    children = {kind: report.read_text() if report.exists() else "no report" for kind, report in reports.items()}
    return {
        "phase": phase,
        "before": before,
        "after": after,
        "parent_before": parent_before,
        "parent": _load_digest(path),
        "children": {k: v for k, v in children.items() if k != "exit"},
        "exit_codes": [worker.exitcode],
    }


def _free_forks(trainer: Any, out: Path, rounds: int) -> dict[str, Any]:
    """Forks in a loop while a save runs, no phase held: children exit normally at once or load."""
    path = out / "a.ortcp"
    before, after, loads, forks = [], [], [], 0
    for round_ in range(rounds):
        gate_r, gate_w = os.pipe()
        handle = trainer.save_checkpoint(path, async_save=True, overwrite=True)
        pids = []
        while not handle.done() and len(pids) < 16:
            kind = "load" if len(pids) % 2 else "exit"
            report = out / f"free-{round_}-{len(pids)}.txt"
            pid = os.fork()
            if pid == 0:
                os.close(gate_w)
                _child(kind, gate_r, path, report)
                sys.exit(0)
            pids.append((pid, kind, report))
        handle.wait()
        before.append(_sha(path))
        os.close(gate_w)
        for pid, kind, report in pids:
            os.waitpid(pid, 0)
            if kind == "load":
                loads.append(report.read_text() if report.exists() else "no report")
        os.close(gate_r)
        after.append(_sha(path))
        forks += len(pids)
    return {
        "phase": "free",
        "before": before,
        "after": after,
        "parent": _load_digest(path),
        "children": loads,
        "forks": forks,
    }


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    trainer = mlp_trainer(hidden=4096)
    trainer.train_step(*mlp_batches(1)[0])
    if mode == "free":
        trainer.save_checkpoint(out / "a.ortcp")
        print(json.dumps(_free_forks(trainer, out, rounds=int(sys.argv[3]))), flush=True)
        return
    hold = _Hold()
    leaves = sum(1 for _ in _leaves(trainer.state_dict()))
    phases = [("first-dataset", 0, False), ("halfway", leaves // 2, False), ("before-close", None, True)]
    for number, (phase, leaf_index, at_reserve) in enumerate(phases):
        hold.arm(leaf_index, at_reserve)
        print(json.dumps(_save_with_forks(trainer, out, phase, hold, overwrite=number > 0)), flush=True)


def _leaves(tree: Any):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


if __name__ == "__main__":
    main()
