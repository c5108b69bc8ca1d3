"""Saving onto a full device: a clear CheckpointWriteError, the old checkpoint intact, no temp file, no crash.

Each scenario runs in a child process (a crash there fails the test instead of killing pytest): it saves
a checkpoint, then tries to overwrite it while the space runs out at a different point of the save each
time (a sweep over the limit: raw data, HDF5 metadata, header, fsync), and after each failure checks the
error (an OSError with errno ENOSPC or EFBIG, naming the path), that the old checkpoint loads unchanged,
that no temporary file and no descriptor of a deleted file is left, and that a save succeeds once the
space is back. Two ways to run out: ``RLIMIT_FSIZE`` (any machine) and a small tmpfs (where this process
may mount one, else ``RLIMIT_FSIZE`` again).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.processes  # every test here starts other processes

CHILD = r"""
import errno, gc, json, os, resource, signal, sys
from pathlib import Path
import numpy as np
import torch
from ort_trainer import checkpoint as C

mode, folder, trials, kind, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = folder / "c.ortcp"

def tree(k):
    if kind == "issue":  # the issue's repro: 8 x 15,000 float32
        return {f"w{i}": np.full(15_000, k + i, dtype=np.float32) for i in range(8)}
    if kind == "strings":  # no arrays at all: every byte goes through HDF5 (strings, lists of strings)
        return {f"g{i}": {f"s{j}": f"value {k} " * 20 for j in range(20)} | {"l": [f"x{k}"] * 30} for i in range(40)}
    # metadata-heavy: many small datasets, strings, lists, nested groups
    return {"model": {f"layer{i}": {"w": torch.full((40, 30), float(k + i)), "b": torch.arange(30) + k,
                                    "name": f"layer {i} v{k}", "tags": ["a", "b", str(k)]} for i in range(60)},
            "step": k, "note": "x" * 5000}

trainer = None
if kind == "trainer":  # through ORTTrainer.save_checkpoint / load_checkpoint
    from ort_trainer import ORTTrainer, optim
    model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    desc = {"inputs": [("x", ["batch", 200]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), loss_fn=torch.nn.functional.cross_entropy)

def save(k, overwrite=True, target=None):
    if trainer is not None:
        trainer.save_checkpoint(target or path, user_dict={"version": k}, overwrite=overwrite)
    else:
        C.save(tree(k), target or path, overwrite=overwrite)

def holds(k):
    if trainer is not None:
        return trainer.load_checkpoint(path) == {"version": k}
    return same(C.load(path), tree(k))

def same(loaded, saved):
    if isinstance(saved, dict):
        return isinstance(loaded, dict) and loaded.keys() == saved.keys() and all(
            same(loaded[x], saved[x]) for x in saved)
    if isinstance(saved, np.ndarray):
        saved = torch.from_numpy(saved)
    if isinstance(saved, torch.Tensor):
        return isinstance(loaded, torch.Tensor) and torch.equal(loaded, saved)
    return loaded == saved

def deleted_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith("(deleted)") or str(folder) in target:
            out.append(target)
    return out

def set_space(free):
    # RLIMIT_FSIZE: no file may grow past `free` bytes; tmpfs: a filler leaves `free` bytes on the device
    if mode == "rlimit":
        resource.setrlimit(resource.RLIMIT_FSIZE, (free, resource.RLIM_INFINITY))
        return
    filler = folder / "filler"
    filler.unlink(missing_ok=True)
    st = os.statvfs(folder)
    avail = st.f_bavail * st.f_frsize
    with open(filler, "wb") as fh:
        try:
            fh.write(b"\0" * max(0, avail - free))
        except OSError:
            pass

def space_back():
    if mode == "rlimit":
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    else:
        (folder / "filler").unlink(missing_ok=True)

save(0, target=folder / "probe.ortcp")
full = (folder / "probe.ortcp").stat().st_size
(folder / "probe.ortcp").unlink()
save(0, overwrite=False)
current = 0
for t in range(trials):
    # "sweep": from 1 byte to just below the file's size, so the space runs out at every stage of a save
    free = 1 + (full - 2) * t // max(1, trials - 1) if limit == "sweep" else int(limit)
    set_space(free)
    try:
        save(current + 1)
        result = "saved"
        current += 1
    except C.CheckpointError as exc:
        ok = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG) and str(path) in str(exc)
              and ("no space left" in str(exc) or "file size limit" in str(exc)))
        number = getattr(exc, "errno", None)
        result = type(exc).__name__ if ok else f"BAD ERROR {type(exc).__name__} errno={number}: {exc}"
    except BaseException as exc:
        result = f"WRONG EXCEPTION {type(exc).__name__}: {exc}"
    finally:
        space_back()
    gc.collect()
    problems = []
    leftovers = sorted(p.name for p in folder.iterdir() if p.name not in ("c.ortcp", "filler"))
    if leftovers:
        problems.append(f"left files {leftovers}")
    if deleted_fds():
        problems.append(f"open descriptors {deleted_fds()}")
    if not holds(current):
        problems.append("the checkpoint changed")
    save(current + 1)   # the process is healthy: saving works again
    current += 1
    if not holds(current):
        problems.append("the next save did not round-trip")
    print(json.dumps([free, result] + problems), flush=True)
print(json.dumps(["done", full]), flush=True)
"""


def _run(mode: str, folder: Path, trials: int, kind: str, limit="sweep", timeout: float = 300) -> tuple[list, int]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(folder), str(trials), kind, str(limit)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    last = lines[-1] if lines else None
    assert proc.returncode == 0, f"the saving process died ({proc.returncode}) after {last}: {proc.stderr[-3000:]}"
    assert last and last[0] == "done", proc.stderr[-3000:]
    return lines[:-1], last[1]


def _check(lines: list, trials: int) -> None:
    assert len(lines) == trials
    bad = [line for line in lines if line[1] not in ("saved", "CheckpointWriteError") or len(line) > 2]
    assert not bad, bad
    failed = sum(line[1] == "CheckpointWriteError" for line in lines)
    assert failed >= trials - 1, lines  # every limit below the file's size must fail the save


def test_issue_repro_file_size_limit(tmp_path):
    """The issue's repro: 8 x 15,000 float32 over a small checkpoint with RLIMIT_FSIZE 100,000 (crashed 126/154)."""
    lines, full = _run("rlimit", tmp_path, 5, "issue", limit=100_000)
    assert full > 100_000
    _check(lines, 5)


def test_trainer_save_checkpoint_on_full_disk(tmp_path):
    """ORTTrainer.save_checkpoint: the same error, the previous checkpoint loads into the trainer, saving resumes."""
    lines, _ = _run("rlimit", tmp_path, 4, "trainer")
    _check(lines, 4)


def _mount_tmpfs(folder: Path, size: str) -> bool:
    """Mount a small tmpfs at ``folder`` if this process may (root in a container usually may)."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    except FileNotFoundError:
        return False
    return done.returncode == 0


def _on_small_filesystem(trials: int, kind: str, timeout: float = 300) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ckpt-smallfs-"))
    mounted = _mount_tmpfs(folder, "4m")
    try:
        lines, _ = _run("tmpfs" if mounted else "rlimit", folder, trials, kind, timeout=timeout)
        _check(lines, trials)
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)
        shutil.rmtree(folder)


def test_small_filesystem_fills_during_save():
    _on_small_filesystem(4, "metadata")


@pytest.mark.faults
@pytest.mark.parametrize(("kind", "trials"), [("issue", 100), ("metadata", 40), ("strings", 16), ("trainer", 20)])
def test_file_size_limit_sweep_many(tmp_path, kind, trials):
    """The long sweep (make test-faults): the space runs out at every stage of a save, one limit per trial."""
    lines, _ = _run("rlimit", tmp_path, trials, kind, timeout=900)
    _check(lines, trials)


@pytest.mark.faults
def test_issue_repro_many_times(tmp_path):
    lines, _ = _run("rlimit", tmp_path, 100, "issue", limit=100_000, timeout=900)
    _check(lines, 100)


@pytest.mark.faults
def test_small_filesystem_sweep_many():
    _on_small_filesystem(30, "metadata", timeout=900)
