"""Aggregating a ZeRO save into one file: streaming ``aggregate_to_file`` vs building the state in memory.

For each model size a synthetic full state (several float32 weight tensors, one straddling the
ZeRO rank boundary, + Adam moments and update counts) is split with ``checkpoint.reshard_state``
into W=2 ZeRO-1 rank states and saved as two rank files. Contenders, each producing the same
single-process checkpoint file from those rank files:

* ``stream``     ``checkpoint.aggregate_to_file(paths, out)`` (reads, combines, writes one tensor at a time)
* ``in-memory``  ``checkpoint.save(checkpoint.aggregate_checkpoints(paths), out)`` (the full state in memory)
* ``load-all``   ``checkpoint.save(checkpoint.aggregate_states([checkpoint.load(p) for p in paths]), out)``
  (every rank file in memory at once, then the full state too)

Each measurement runs in a fresh subprocess: after the imports the peak-RSS counter is reset
(``/proc/self/clear_refs``), the baseline taken, the contender run; peak extra = VmHWM - baseline.
Seconds are wall time (file writes include flush + fsync; the rank files are in the page cache
for every contender, and dirty pages are synced before each run). ``ratio`` = peak extra memory /
size of the aggregated state (weights + moments). The outputs of all contenders are checked to be
identical tensor for tensor.

    python benchmarks/aggregate.py            # 16, 64, 256 MB of weights, 3 rounds (< 5 min on 2 cores)
    python benchmarks/aggregate.py --quick    # 4, 16 MB, 1 round (< 30 s)
    python benchmarks/aggregate.py --sizes 32 128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONTENDERS = ("stream", "in-memory", "load-all")
HIDDEN = 1024
MB = 1 << 20


# ------------------------------------------------------------------------------------------ worker
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def worker(contender: str, out: str, paths: list[str]) -> None:
    """Run one contender in this (fresh) process; print {"seconds", "peak_extra", "reset"} as JSON."""
    import checkpoint as C  # the imports are part of the baseline, not of the measurement

    reset = _reset_peak()
    base = _status_kib("VmHWM" if reset else "VmRSS") * 1024
    start = time.perf_counter()
    if contender == "stream":
        C.aggregate_to_file(paths, out)
    elif contender == "in-memory":
        C.save(C.aggregate_checkpoints(paths), out)
    elif contender == "load-all":
        C.save(C.aggregate_states([C.load(p) for p in paths]), out)
    else:
        raise SystemExit(f"unknown contender {contender!r}")
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    print(json.dumps({"seconds": seconds, "peak_extra": peak - base, "reset": reset}))


# ------------------------------------------------------------------------------------------ parent
def full_state(weight_mb: int, seed: int = 0) -> dict:
    """A single-process Adam state with ``weight_mb`` MB of float32 weights in several tensors."""
    import torch

    from ort_trainer import checkpoint as C

    rows = weight_mb * MB // 4 // HIDDEN - 4  # 4 bias rows of HIDDEN
    # embedding 3/8, two layers of 1/4 (the first straddles the W=2 boundary), an output layer
    parts = [3 * rows // 8, rows // 4, rows // 4]
    shapes = {"embedding.weight": (parts[0], HIDDEN)}
    for i, n in enumerate(parts[1:]):
        shapes[f"layer{i}.weight"] = (n, HIDDEN)
        shapes[f"layer{i}.bias"] = (HIDDEN,)
    shapes["output.weight"] = (rows - sum(parts), HIDDEN)
    shapes["output.bias"] = (HIDDEN,)
    shapes["norm.weight"] = (HIDDEN,)
    g = torch.Generator().manual_seed(seed)
    model = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    optimizer = {
        n: {
            "Moment_1": torch.randn(s, generator=g),
            "Moment_2": torch.rand(s, generator=g),
            "Update_Count": torch.tensor([101], dtype=torch.int64),
        }
        for n, s in shapes.items()
    }
    return {
        "model": {"full_precision": model},
        "optimizer": optimizer,
        "trainer_options": C.TrainerOptionsRecord(
            mixed_precision=False,
            zero_stage=0,
            world_rank=0,
            world_size=1,
            optimizer_name="AdamOptimizer",
            data_parallel_size=1,
            horizontal_parallel_size=1,
        ).to_tree(),
        "train_step_info": {"optimization_step": 100, "step": 100},
    }


def write_rank_files(weight_mb: int, folder: Path) -> tuple[list[Path], int]:
    """Save the W=2 ZeRO-1 rank files of a synthetic state; return them and the full state's bytes."""
    from ort_trainer import checkpoint as C

    full = full_state(weight_mb)
    tensors = [*full["model"]["full_precision"].values(), *(v for e in full["optimizer"].values() for v in e.values())]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    paths = []
    for state in C.reshard_state(full, 2, zero_stage=1):
        path = C.rank_checkpoint_path(folder / "ckpt.ortcp", state["trainer_options"]["world_rank"], 2)
        C.save(state, path)
        paths.append(path)
    return paths, nbytes


def measure(contender: str, out: Path, paths: list[Path]) -> dict:
    out.unlink(missing_ok=True)
    os.sync()  # no writeback of earlier files (rank files, other outputs) inside the measurement
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", contender, "--out", str(out), *map(str, paths)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{contender} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_files(a: Path, b: Path) -> bool:
    """The two checkpoints hold the same keys and bit-identical values (one tensor in memory at a time)."""
    import torch

    from ort_trainer import checkpoint as C

    with C.open_checkpoint(a) as ra, C.open_checkpoint(b) as rb:
        keys = [k for k, _ in ra.walk()]
        if keys != [k for k, _ in rb.walk()]:
            return False
        for key in keys:
            x, y = ra.read(key), rb.read(key)
            if isinstance(x, torch.Tensor):
                if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                    return False
            elif x != y:
                return False
    return True


def run(sizes: list[int], rounds: int) -> list[tuple]:
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-aggregate-") as tmp:
            folder = Path(tmp)
            paths, state_bytes = write_rank_files(size, folder)
            results: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
            for r in range(rounds):  # interleaved rounds, rotated start
                for contender in CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]:
                    results[contender].append(measure(contender, folder / f"{contender}.ortcp", paths))
            outs = [folder / f"{c}.ortcp" for c in CONTENDERS]
            if not all(same_files(outs[0], o) for o in outs[1:]):
                raise RuntimeError(f"{size} MB: the contenders' outputs differ")
            for contender in CONTENDERS:
                seconds = statistics.median(m["seconds"] for m in results[contender])
                peak = statistics.median(m["peak_extra"] for m in results[contender])
                rows.append((size, state_bytes, contender, seconds, peak, all(m["reset"] for m in results[contender])))
            print(f"  {size} MB done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[tuple]) -> str:
    lines = [
        "| size (fp32 weights) | contender | seconds | peak extra MB | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for size, state_bytes, contender, seconds, peak, _ in rows:
        lines.append(
            f"| {size} MB (state {state_bytes / MB:.0f} MB) | {contender} | {seconds:.2f} | {peak / MB:.0f} | "
            f"{peak / state_bytes:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 and 16 MB, 1 round (smoke test, < 30 s)")
    parser.add_argument("--sizes", type=int, nargs="+", help="MB of fp32 weights (default 16 64 256)")
    parser.add_argument("--rounds", type=int, help="runs per contender and size; the median is reported (default 3)")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.paths)
        return
    from benchmarks._common import print_host_stamp  # here: worker processes must not import it

    print_host_stamp()
    sizes = args.sizes or ([4, 16] if args.quick else [16, 64, 256])
    rounds = args.rounds or (1 if args.quick else 3)
    if min(sizes) < 1 or rounds < 1:
        parser.error("sizes and rounds must be >= 1")
    start = time.perf_counter()
    rows = run(sizes, rounds)
    print(table(rows))
    note = "" if all(r[5] for r in rows) else " (VmHWM could not be reset: baseline is RSS after imports)"
    print(
        f"\nW=2 ZeRO-1, Adam; ratio = peak extra memory / aggregated state size; median of {rounds} round(s); "
        f"each run in a fresh process{note}; total {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
