"""What the graph cache's pre-key saves a resumed job (issue V, point 5): the time to the first training step.

    python benchmarks/graph_cache.py --model gpt2-small --rounds 3
    python benchmarks/graph_cache.py --model gpt2-124m --rounds 2

Each measurement is a fresh process (this script with --child), as a resumed job is: it builds the model, an
``ORTTrainer`` (autograd engine, symbolic ``batch``/``seq``, AdamW) and times ``ORTTrainer(...)`` plus the
first ``train_step``, then three more steps (the verifying trace of a pre-key hit runs beside them). Modes:

* cold: an empty graph cache: trace, export, the ONNX passes, the session;
* pre-key: the cache that a cold run filled; the graph found by the pre-key (`graph.autograd._quick_key`, read off
  the module without a trace) runs at once, and the trace that verifies it runs in a thread beside the first steps;
* trace-key: the same cache with the pre-key switched off (``_found_by_pre_key`` returns None): the model is traced
  first, and the graph is found by the full key of that trace (no export, no passes).

Rounds interleave the modes (the order reversed every other round); the table gives medians of wall and process
CPU seconds, the first step alone and the first four steps. The pre-key saves the trace; the question it
answers is whether that saving pays for the pre-key's code once symbolic shapes make the trace happen once per
mode (not once per shape).
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
MODES = ("cold", "pre-key", "trace-key")


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
    from ort_trainer.engine import _autograd_build

    if args.child == "trace-key":
        _autograd_build._found_by_pre_key = lambda *a, **k: None
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
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="graph_cache_bench_") as folder:
            cache = Path(folder)
            results["cold"].append(_run(args, "cold", cache))  # fills the cache
            order = ["pre-key", "trace-key"] if r % 2 == 0 else ["trace-key", "pre-key"]
            for mode in order:
                results[mode].append(_run(args, mode, cache))
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
