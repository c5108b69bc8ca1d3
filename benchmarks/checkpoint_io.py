"""Checkpoint I/O: save/load throughput, training-loop stall of a save (sync vs async), peak extra memory.

One interleaved run on the same state (a real trainer's weights + Adam moments, ~113M float32 values =
432 MiB by default), same disk, rounds interleaved (the order reversed every other round, ``os.sync()``
before each contender so that none pays for another's dirty pages), medians reported:

* save: ORTTrainer ``save_checkpoint`` (HDF5, checksums, fsync of file + folder, atomic publish),
  ``torch.save`` + fsync, ``torch.save`` without fsync, safetensors ``save_file``, torch DCP ``save`` and
  ``async_save`` (single process, ``FileSystemWriter``: fsyncs its files);
* load: ``load_checkpoint`` (verifies every checksum, reads straight into the trainer's buffers),
  ``torch.load(weights_only=True)``, safetensors ``load_file``, DCP ``load`` (into preallocated tensors);
* stall: a loop of STEPS ``train_step`` calls with one save at its start; "blocked" is how long the
  save held the loop (the call, plus for our async save the wait of ``train_step`` for the snapshot
  copy before its update); the loop's wall time against a loop without a save is shown too (it also
  counts CPU contention from a background write, and is noisy on a shared machine);
* peak extra memory of an asynchronous save: peak RSS from the call until the file is published, minus
  RSS before it, sampled every 2 ms; the first save allocates the host snapshot, later ones reuse it.

    python benchmarks/checkpoint_io.py               # ~113M values, 3 rounds (~3 minutes)
    python benchmarks/checkpoint_io.py --quick       # ~10M values, 1 round (smoke test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from ort_trainer import ORTTrainer, optim

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ce = torch.nn.functional.cross_entropy
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Samples RSS in a thread; ``extra`` is the peak above the value at entry."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.extra = self.peak - self.base


def make_trainer(width: int, depth: int) -> ORTTrainer:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    desc = {"inputs": [("x", ["batch", width]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-4), loss_fn=ce)
    trainer.train_step(*batch(width))
    return trainer


def batch(width: int):
    return torch.randn(2, width), torch.randint(0, 4, (2,))


def flat_state(trainer: ORTTrainer) -> dict[str, torch.Tensor]:
    """The same tensors as a flat {name: tensor} dict, for torch.save, safetensors and DCP."""
    state = trainer.state_dict()
    flat = {f"model/{k}": v for k, v in state["model"]["full_precision"].items()}
    for name, entry in state["optimizer"].items():
        for key, value in entry.items():
            flat[f"optimizer/{name}/{key}"] = torch.as_tensor(value)
    return flat


def fsynced_torch_save(state, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def timed(fn):
    # Every contender starts with no dirty page cache: otherwise the one after a no-fsync writer pays,
    # in its own fsync, for writing back the previous contender's data (ext4 commits it together).
    os.sync()
    start = time.perf_counter()
    with PeakRSS() as peak:
        result = fn()
    return time.perf_counter() - start, peak.extra, result


class Results:
    def __init__(self):
        self.data: dict[tuple[str, str], list[float]] = {}

    def add(self, name: str, kind: str, value: float) -> None:
        self.data.setdefault((name, kind), []).append(value)

    def median(self, name: str, kind: str) -> float | None:
        values = self.data.get((name, kind))
        return statistics.median(values) if values else None


def io_round(trainer, target, reference, folder: Path, results: Results, reverse: bool = False) -> None:
    """One round of every save and load contender; ``reverse`` runs them in the opposite order."""
    ours, pt, st = folder / "ours.ortcp", folder / "state.pt", folder / "state.safetensors"
    dcp_dir, dcp_async_dir = folder / "dcp", folder / "dcp_async"
    contenders = [
        ("ORTTrainer save_checkpoint", lambda: trainer.save_checkpoint(ours, overwrite=True)),
        (
            "ORTTrainer save_checkpoint(async_save=True)",
            lambda: trainer.save_checkpoint(ours, overwrite=True, async_save=True).wait(),
        ),
        ("torch.save + fsync", lambda: fsynced_torch_save(reference, pt)),
        ("torch.save (no fsync)", lambda: torch.save(reference, pt)),
        ("safetensors save_file (no fsync)", lambda: safetensors.torch.save_file(reference, st)),
        ("DCP save", lambda: dcp.save(reference, checkpoint_id=fresh(dcp_dir))),
        ("DCP async_save", lambda: dcp.async_save(reference, checkpoint_id=fresh(dcp_async_dir)).result()),
    ]
    for name, fn in reversed(contenders) if reverse else contenders:
        seconds, extra, _ = timed(fn)
        results.add(name, "save_s", seconds)
        results.add(name, "save_mem", extra)
    loads = [
        ("ORTTrainer save_checkpoint", lambda: target.load_checkpoint(ours)),
        ("torch.save + fsync", lambda: torch.load(pt, weights_only=True)),
        ("safetensors save_file (no fsync)", lambda: safetensors.torch.load_file(st)),
        ("DCP save", lambda: dcp.load({k: torch.empty_like(v) for k, v in reference.items()}, checkpoint_id=dcp_dir)),
    ]
    for name, fn in reversed(loads) if reverse else loads:
        seconds, extra, loaded = timed(fn)
        del loaded
        results.add(name, "load_s", seconds)
        results.add(name, "load_mem", extra)


def stall_round(trainer, width: int, steps: int, folder: Path, results: Results) -> None:
    """``steps`` train steps with one save at the start, for: no save, sync, async, DCP async_save.

    "blocked" is the time the loop could not train because of the save: the save call, plus (async) the
    time ``train_step`` waited for the snapshot copy before its update. "loop" is the loop's wall time.
    """
    inputs = batch(width)
    writer = trainer.trainer_state.checkpoint_io.writer
    fence = {"s": 0.0}
    real_wait = type(writer).wait_for_snapshot

    def timed_wait(self):
        t0 = time.perf_counter()
        real_wait(self)
        fence["s"] += time.perf_counter() - t0

    def loop(save=None):
        fence["s"] = 0.0
        start = time.perf_counter()
        called = 0.0
        for i in range(steps):
            if i == 0 and save is not None:
                t0 = time.perf_counter()
                handle = save()
                called = time.perf_counter() - t0
            trainer.train_step(*inputs)
        elapsed = time.perf_counter() - start
        if save is not None:
            handle.wait()  # outside the loop's time: published before the next measurement
        return elapsed, called + fence["s"]

    path, dcp_dir = folder / "stall.ortcp", folder / "stall_dcp"
    contenders = (
        ("no save", None),
        ("sync", lambda: trainer.save_checkpoint(path, overwrite=True)),
        ("async", lambda: trainer.save_checkpoint(path, overwrite=True, async_save=True)),
        ("DCP async_save", lambda: _DcpHandle(dcp.async_save(flat_state(trainer), checkpoint_id=fresh(dcp_dir)))),
    )
    writer.wait_for_snapshot = timed_wait.__get__(writer)
    try:
        for name, save in contenders:
            os.sync()
            elapsed, blocked = loop(save)
            results.add(name, "loop_s", elapsed)
            results.add(name, "blocked_s", blocked)
    finally:
        del writer.wait_for_snapshot


class _DcpHandle:
    def __init__(self, future):
        self.future = future

    def wait(self):
        self.future.result()


def async_memory(trainer, folder: Path, state_bytes: int) -> tuple[float, float]:
    """Peak extra memory (x the state) of a first asynchronous save (snapshot allocated) and of a later one."""
    out = []
    for _ in range(2):
        with PeakRSS() as peak:
            trainer.save_checkpoint(folder / "mem.ortcp", overwrite=True, async_save=True).wait()
        out.append(peak.extra / state_bytes)
    return out[0], out[1]


def run(args) -> None:
    torch.set_num_threads(2)
    trainer = make_trainer(args.width, args.depth)
    target = make_trainer(args.width, args.depth)
    reference = flat_state(trainer)
    size = sum(t.numel() * t.element_size() for t in reference.values())
    print(
        f"state: {size / 4 / 1e6:.1f}M float32 values, {size / 2**20:.0f} MiB; {args.rounds} interleaved rounds; "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    results = Results()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        first, steady = async_memory(trainer, folder, size)  # first: nothing else has run in this process yet
        stall_round(trainer, args.width, 2, folder, Results())  # warm-up (page cache, threads)
        for round_index in range(args.rounds):
            io_round(trainer, target, reference, folder, results, reverse=round_index % 2 == 1)
            stall_round(trainer, args.width, args.steps, folder, results)
        trainer.save_checkpoint(folder / "check.ortcp", async_save=True).wait()
        target.load_checkpoint(folder / "check.ortcp")
    got, expected = flat_state(target), flat_state(trainer)
    assert all(torch.equal(got[k], expected[k]) for k in expected), "round trip changed the state"
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print_tables(results, size, args.steps, first, steady)


def print_tables(results: Results, size: int, steps: int, first: float, steady: float) -> None:
    base_save = results.median("torch.save + fsync", "save_s")
    base_load = results.median("torch.save + fsync", "load_s")
    print("\n| contender | save GB/s | save × torch.save+fsync | save peak extra | load GB/s | load × torch.load |")
    print("|---|---|---|---|---|---|")
    names = dict.fromkeys(name for name, _ in results.data)
    for name in names:
        save = results.median(name, "save_s")
        if save is None:
            continue
        load = results.median(name, "load_s")
        mem = max(results.data[(name, "save_mem")]) / size
        load_cols = f"{size / load / 1e9:.2f} | {base_load / load:.2f}x" if load else " | "
        print(f"| {name} | {size / save / 1e9:.2f} | {base_save / save:.2f}x | {mem:.1%} | {load_cols} |")
    sync_save = results.median("ORTTrainer save_checkpoint", "save_s")
    no_save = results.median("no save", "loop_s")
    print(
        f"\n| {steps} train steps, one save at the start | training blocked by the save, s | ÷ sync save | "
        "loop wall time, s | loop − no-save loop, s |"
    )
    print("|---|---|---|---|---|")
    for name in ("no save", "sync", "async", "DCP async_save"):
        loop, blocked = results.median(name, "loop_s"), results.median(name, "blocked_s")
        print(f"| {name} | {blocked:.3f} | {blocked / sync_save:.1%} | {loop:.2f} | {loop - no_save:+.2f} |")
    print(
        f"\nasync save peak extra memory: first save {first:.2f}x the state (allocates the snapshot), "
        f"later saves {steady:.2f}x (the snapshot is reused)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small state, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="train steps per stall measurement")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=9, help="hidden layers of width x width")
    parser.add_argument("--dir", default=None, help="folder for the files (default: system temp)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.rounds = 1024, 3, 1
    from benchmarks._common import print_host_stamp  # here: worker processes must not import it

    print_host_stamp()
    run(args)


if __name__ == "__main__":
    main()
