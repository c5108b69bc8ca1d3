"""Checkpoint save/load throughput and peak extra memory: ORTTrainer vs torch.save/load vs safetensors.

The state is a real trainer's (weights + Adam moments, >= 100M float32 values by default). Every
contender writes the same tensors to the same disk in the same run; rounds are interleaved and the
median is reported. Our save includes flush + fsync of file and folder (crash safety) and our load
verifies every checksum before reading into the trainer's buffers; torch.save and safetensors do
neither, so the comparison is unfavourable to us by design.
Peak extra memory = peak RSS during the operation minus RSS before it, sampled every 2 ms.

    python benchmarks/checkpoint_io.py               # ~110M values, 3 rounds
    python benchmarks/checkpoint_io.py --quick       # ~10M values, 1 round (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import safetensors.torch
import torch

from ort_trainer import ORTTrainer, optim

ce = torch.nn.functional.cross_entropy


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
    trainer.train_step(torch.randn(2, width), torch.randint(0, 4, (2,)))
    return trainer


def flat_state(trainer: ORTTrainer) -> dict[str, torch.Tensor]:
    """The same tensors as a flat {name: tensor} dict, for torch.save and safetensors."""
    state = trainer.state_dict()
    flat = {f"model/{k}": v for k, v in state["model"]["full_precision"].items()}
    for name, entry in state["optimizer"].items():
        for key, value in entry.items():
            flat[f"optimizer/{name}/{key}"] = value
    return flat


def timed(fn, memory: bool = True):
    start = time.perf_counter()
    with PeakRSS() as peak:
        result = fn()
    return time.perf_counter() - start, peak.extra, result


def run(args) -> None:
    torch.set_num_threads(2)
    trainer = make_trainer(args.width, args.depth)
    reference = flat_state(trainer)
    values = sum(t.numel() for t in reference.values() if t.is_floating_point())
    size = sum(t.numel() * t.element_size() for t in reference.values())
    print(f"state: {values / 1e6:.1f}M float32 values, {size / 2**20:.0f} MiB; {args.rounds} interleaved rounds")
    results: dict[str, dict[str, list[float]]] = {}
    target = make_trainer(args.width, args.depth)

    def record(name, kind, seconds, extra):
        entry = results.setdefault(name, {"save_s": [], "save_mem": [], "load_s": [], "load_mem": []})
        entry[f"{kind}_s"].append(seconds)
        entry[f"{kind}_mem"].append(extra)

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        folder = Path(folder)
        ours, pt, st = folder / "ours.ortcp", folder / "state.pt", folder / "state.safetensors"
        for _ in range(args.rounds):
            t, m, _ = timed(lambda: trainer.save_checkpoint(ours, overwrite=True))
            record("ort_trainer (HDF5)", "save", t, m)
            t, m, _ = timed(lambda: target.load_checkpoint(ours))
            record("ort_trainer (HDF5)", "load", t, m)
            t, m, _ = timed(lambda: torch.save(reference, pt))
            record("torch.save/load", "save", t, m)
            t, m, loaded = timed(lambda: torch.load(pt, weights_only=True))
            record("torch.save/load", "load", t, m)
            del loaded
            t, m, _ = timed(lambda: safetensors.torch.save_file(reference, st))
            record("safetensors", "save", t, m)
            t, m, loaded = timed(lambda: safetensors.torch.load_file(st))
            record("safetensors", "load", t, m)
            del loaded
    # the loaded trainer must hold exactly the saved state
    got = flat_state(target)
    assert all(torch.equal(got[k], reference[k]) for k in reference), "round trip changed the state"
    print_table(results, size)


def print_table(results, size) -> None:
    base = statistics.median(results["torch.save/load"]["save_s"])
    base_load = statistics.median(results["torch.save/load"]["load_s"])
    print(
        "\n| contender | save GB/s | save vs torch.save | save peak extra | load GB/s | load vs torch.load | "
        "load peak extra |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        save, load = statistics.median(r["save_s"]), statistics.median(r["load_s"])
        print(
            f"| {name} | {size / save / 1e9:.2f} | {base / save:.2f}x | {max(r['save_mem']) / size:.1%} | "
            f"{size / load / 1e9:.2f} | {base_load / load:.2f}x | {max(r['load_mem']) / size:.1%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small state, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=9, help="hidden layers of width x width")
    parser.add_argument("--dir", default=None, help="folder for the files (default: system temp)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.rounds = 1024, 3, 1
    run(args)


if __name__ == "__main__":
    main()
