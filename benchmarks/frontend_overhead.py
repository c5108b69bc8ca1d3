"""The fixed per-step cost of ORTTrainer's frontend, in microseconds.

    python benchmarks/frontend_overhead.py                 # tiny MLP, README MLP, README LM
    python benchmarks/frontend_overhead.py --models mlp --rounds 9

For each model, interleaved and in the same process (medians over --rounds rounds of --steps calls):
  train_step   ORTTrainer.train_step (forward + backward + AdamW update + everything around them)
  ort run      the training session's run_with_iobinding alone, on the inputs train_step bound last
  update       the optimizer's step() alone (the fused AdamW over the flat buffers)
  run+update   the two back to back, as in a step (the update evicts what the run had in cache)
  frontend     train_step - (run+update): input checks and binding, output binding and wrapping,
               bookkeeping: the Python glue
"tiny" is a 20-16-4 MLP whose compute is negligible, so its train_step is almost all fixed cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import MLP, MODELS, ModelSpec, ort_trainer_step, print_host_stamp, session_options

TINY = ModelSpec(
    "tiny",
    "MLP 20-16-4, batch 8",
    lambda: MLP(20, 16, 4),
    {"inputs": [("x", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]},
    torch.nn.functional.cross_entropy,
    lambda n: [(torch.randn(8, 20), torch.randint(0, 4, (8,))) for _ in range(n)],
)
SPECS = {"tiny": TINY, **MODELS}
STEPS = {"tiny": 200, "mlp": 30, "lm": 4}


def measure(spec: ModelSpec, args) -> dict[str, float]:
    torch.manual_seed(0)
    batches = spec.batches(2)
    options = None if args.threads is None else session_options(args.threads, spinning=False)
    step, trainer = ort_trainer_step(spec, spec.make(), options, True, batches[0])
    engine = trainer.trainer_state.engine  # the benchmark times the two halves of a step separately
    session, io = engine.session._train, engine.session._train_io
    parts = {
        "train_step": lambda: step(batches[0]),
        "ort run": lambda: session.run_with_iobinding(io),
        "update": lambda: engine.optimizer.step(1e-3, clip=False),
        "run+update": lambda: (session.run_with_iobinding(io), engine.optimizer.step(1e-3, clip=False)),
    }
    n = args.steps or STEPS[spec.name]
    for part in parts.values():
        part()
    times = {name: [] for name in parts}
    for r in range(args.rounds):
        for name in parts if r % 2 == 0 else list(reversed(parts)):
            start = time.perf_counter()
            for _ in range(n):
                parts[name]()
            times[name].append((time.perf_counter() - start) / n * 1e6)
    result = {name: statistics.median(v) for name, v in times.items()}
    result["frontend"] = result["train_step"] - result["run+update"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,mlp,lm")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=None, help="calls per round (default: tiny 200, mlp 30, lm 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads and ORT intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print_host_stamp()
    print(f"torch threads {torch.get_num_threads()}, 1-min load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    print("| model | train_step µs | ORT run µs | update µs | run+update µs | frontend µs | frontend share |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        r = measure(SPECS[name], args)
        print(
            f"| {name} | {r['train_step']:.0f} | {r['ort run']:.0f} | {r['update']:.0f} | {r['run+update']:.0f} | "
            f"{r['frontend']:.0f} | "
            f"{r['frontend'] / r['train_step']:.1%} |",
            flush=True,
        )
    print(f"\n1-min load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
