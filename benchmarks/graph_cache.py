"""What the graph cache saves a resumed job: the time to the first training step, cold against warm.

    python benchmarks/graph_cache.py --model gpt2-small --rounds 3
    python benchmarks/graph_cache.py --model gpt2-124m --rounds 2

Each measurement is a fresh process (this script with --child), as a resumed job is: it builds the model, an
``ORTTrainer`` (autograd engine, symbolic ``batch``/``seq``, AdamW) and times ``ORTTrainer(...)`` plus the
first ``train_step``, then three more steps. Modes:

* cold: an empty graph cache: trace, export, the ONNX passes, the session;
* warm: the cache that a cold run filled: the model is traced, and the graph is found by the full key of that
  trace (no export, no passes).

Rounds run cold then warm on a fresh cache folder; the table gives medians of wall and process CPU seconds, the
first step alone and the first four steps.

This script first measured the cache's pre-key (issue V, point 5): a key read off the module without a trace,
whose graph ran the first step while the verifying trace ran in a thread beside it. GPT-2 small, 1 thread,
medians, AMD EPYC 2 cores AVX-512 at load ~4, torch 2.13.0, onnxruntime 1.31.1, first step (trainer included):

| mode | wall s | CPU s |
|---|---|---|
| cold | 105 | 35.5 |
| pre-key | 17.5 | 6.10 |
| trace-key (the warm mode now) | 19.5 | 6.37 |

With symbolic shapes the trace happens once per mode, not once per shape, so the pre-key saved ~4% of a resume's
CPU time (~10% of its wall time on that loaded host) for a thread, a rollback path and ~400 lines: it was removed
(docs/engines.md, "Graph cache").
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

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import print_host_stamp, set_torch_threads
from benchmarks._hf import scale_spec

_CACHE_ENV = "ORT_TRAINER_GRAPH_CACHE_DIR"
MODES = ("cold", "warm")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--cache", type=Path)
    return parser.parse_args(argv)


def child(args) -> None:
    """One resumed (or first) job: seconds to the first step and to four steps, wall and CPU; printed as JSON."""
    from ort_trainer import ORTTrainer, optim

    set_torch_threads(args.threads)
    spec = scale_spec(args.model)
    torch.manual_seed(0)
    model = spec.make()
    batches = spec.batches(4)
    lengths = (96, 64, 128, 80)  # other lengths each step: the symbolic graph serves them all
    batches = [tuple(t[:, :n] if t.dim() == 2 else t for t in b) for b, n in zip(batches, lengths, strict=True)]
    os.environ[_CACHE_ENV] = str(args.cache)
    options = {"utils": {"engine": "autograd"}}
    config = optim.AdamConfig(lr=1e-3, lambda_coef=0.0)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer = ORTTrainer(model, spec.desc, config, loss_fn=spec.loss_fn, options=options)
    trainer.train_step(*batches[0])
    first = (time.perf_counter() - wall, time.process_time() - cpu)
    for batch in batches[1:]:
        trainer.train_step(*batch)
    four = (time.perf_counter() - wall, time.process_time() - cpu)
    print(json.dumps({"first": first, "four": four}))


def _run(args, mode: str, cache: Path) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--model", args.model, "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([*command, "--cache", str(cache)], env=env, capture_output=True, text=True, cwd=root)
    if out.returncode:
        raise SystemExit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    print_host_stamp()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="graph_cache_bench_") as folder:
            cache = Path(folder)
            results["cold"].append(_run(args, "cold", cache))  # fills the cache
            results["warm"].append(_run(args, "warm", cache))
    print(f"{args.model}: seconds from ORTTrainer(...) to the end of the first step, and of four steps "
          f"(lengths 96, 64, 128, 80); medians of {args.rounds} rounds, {args.threads} thread(s)\n")  # fmt: skip
    print("| mode | first step wall s | first step CPU s | four steps wall s | four steps CPU s |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        cells = [
            statistics.median(x[key][i] for x in results[mode]) for key in ("first", "four") for i in (0, 1)
        ]  # fmt: skip
        print(f"| {mode} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
