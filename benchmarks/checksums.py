"""Per-tensor checksums: CRC-32C (format version 2) against zlib's CRC-32 (version 1), alone and in a save.

Two tables, contenders interleaved round by round, medians reported:

1. checksum throughput over one large array already in memory: zlib ``crc32`` (format 1), CRC-32C
   as the library computes it (``_checksum.CRC32C.array``: the ``crc32c`` package on a view of the
   array's memory), and ``google_crc32c`` over ``bytes`` copies of 1 MiB (its Python API takes only
   ``bytes``: what using that package would cost);
2. ``checkpoint.save`` + ``checkpoint.load`` of the same state (several float32 tensors) by the
   current code and by the code of a baseline commit (default ``a94ec31``: format version 1, HDF5
   writes the arrays and zlib CRC-32 runs in a second pass on worker threads), each run in a fresh
   subprocess, in a folder on tmpfs (``/dev/shm``, where the checksum is a visible part of the cost)
   and on the disk (``--disk-dir``). Save includes fsync and publish; load verifies every checksum.

    python benchmarks/checksums.py                     # 256 MiB state, 5 rounds
    python benchmarks/checksums.py --mib 64 --rounds 3 # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from io import BytesIO
from pathlib import Path

import google_crc32c
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SAVE_LOAD = r"""
import json, os, sys, time
import torch
baseline, folder, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
if baseline != "-":
    sys.path.insert(0, baseline)
    import checkpoint as C          # the baseline commit's package, extracted there
else:
    from ort_trainer import checkpoint as C
gen = torch.Generator().manual_seed(0)
n = mib * (1 << 20) // 4 // 16
tree = {"model": {f"w{i}": torch.randn(n, generator=gen) for i in range(16)}}
path = os.path.join(folder, "bench.ortcp")
t0 = time.perf_counter(); C.save(tree, path, overwrite=True); t1 = time.perf_counter()
loaded = C.load(path); t2 = time.perf_counter()
assert all(torch.equal(loaded["model"][k], v) for k, v in tree["model"].items())
os.unlink(path)
print(json.dumps([t1 - t0, t2 - t1]))
"""


def _checksum_table(mib: int, rounds: int) -> list[tuple[str, float]]:
    from ort_trainer.checkpoint.format._checksum import CRC32C

    array = np.random.default_rng(0).random(mib * (1 << 20) // 8)

    def copies() -> int:
        crc, flat = 0, array.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, 1 << 20):
            crc = google_crc32c.extend(crc, flat[start : start + (1 << 20)].tobytes())
        return crc

    contenders = {
        "zlib CRC-32 (format 1)": lambda: zlib.crc32(array),
        "CRC-32C on the array's memory (format 2: crc32c package, no copy)": lambda: CRC32C.array(array),
        "CRC-32C, google_crc32c through 1 MiB bytes copies": copies,
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return [(name, array.nbytes / statistics.median(ts) / 1e9) for name, ts in times.items()]


def _extract(rev: str, into: Path) -> Path:
    """The baseline commit's ``checkpoint`` package, extracted as a top-level package under ``into``."""
    archive = subprocess.run(["git", "archive", rev, "checkpoint"], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _save_load(baseline: str, folder: Path, mib: int) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", SAVE_LOAD, baseline, str(folder), str(mib)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the state (and of the checksummed array)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", default="a94ec31", help="commit whose checkpoint package is compared")
    parser.add_argument("--disk-dir", default=None, help="folder on the disk (default: a temporary folder)")
    args = parser.parse_args()
    from benchmarks._common import print_host_stamp  # here: worker processes must not import it

    print_host_stamp()
    print(f"checksum throughput, {args.mib} MiB float64 array, median of {args.rounds}")
    print("| checksum | GB/s |\n|---|---|")
    for name, speed in _checksum_table(args.mib, args.rounds):
        print(f"| {name} | {speed:.2f} |")

    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryDirectory(dir=args.disk_dir) as disk:
        old = str(_extract(args.baseline, Path(scratch)))
        folders = {"tmpfs": Path(tempfile.mkdtemp(dir="/dev/shm")), "disk": Path(disk)}
        nbytes = args.mib * (1 << 20)
        print(f"\nsave + load of {args.mib} MiB (16 float32 tensors), median of {args.rounds} interleaved rounds")
        print("| where | contender | save GB/s | load GB/s |\n|---|---|---|---|")
        for where, folder in folders.items():
            times: dict[str, list[tuple[float, float]]] = {args.baseline: [], "current": []}
            for _ in range(args.rounds):
                times[args.baseline].append(_save_load(old, folder, args.mib))
                times["current"].append(_save_load("-", folder, args.mib))
            for name, runs in times.items():
                save = nbytes / statistics.median(r[0] for r in runs) / 1e9
                load = nbytes / statistics.median(r[1] for r in runs) / 1e9
                label = f"{name} (format {1 if name == args.baseline else 2})"
                print(f"| {where} | {label} | {save:.2f} | {load:.2f} |")
        for folder in folders.values():
            if folder.parent == Path("/dev/shm"):
                for p in folder.iterdir():
                    p.unlink()
                folder.rmdir()


if __name__ == "__main__":
    main()
