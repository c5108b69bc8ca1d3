"""Steps/s of ORTTrainer vs eager PyTorch vs the bare onnxruntime.training.api loop.

    python benchmarks/train_step.py                       # default: ~1.5 min idle, ~4 min on a busy 2-core box
    python benchmarks/train_step.py --quick               # smoke run, < 60 s
    python benchmarks/train_step.py --models lm --rounds 7 --steps 8 --json out.json

Contenders (same model, initial weights, batches and AdamW hyper-parameters, see `_common`):
  pytorch          eager forward/backward + torch.optim.AdamW (fused CPU kernel by default)
  compile          torch.compile(model) (inductor) forward/backward + the fused AdamW
  ort_api          onnxruntime.training.api Module + Optimizer (generate_artifacts, OptimType.AdamW;
                   its AdamWOptimizer uses adam_mode=1, the HF-transformers formula: same cost, and
                   its losses drift slightly from the other two, which match each other)
  ort_trainer      ORTTrainer on the same forward graph as ort_api
  suffix +rw       with the CPU graph rewrites of ort_trainer.graph (forward and training graph)
  suffix +nospin   ORT session.intra_op.allow_spinning=0 (+spin: =1; default: ORT's default, 1)
  suffix +stopspin ORT session.force_spinning_stop=1 (threads spin during Run, stop when it returns)

Method: each contender is built and warmed up first (build/export time is not counted), then
``--rounds`` rounds; in each round every contender runs ``--steps`` steps back to back, the order
alternating (forward / reversed) between rounds. ms/step is the median over rounds of each round's
mean; "min" is the fastest round; "CPU ms" is process CPU time per step (all threads, spin-waits
included): a view that depends less on other load when the machine is shared. "x PyTorch" and
"x bare ORT" are speed ratios (contender steps/s over the reference's; > 1 is faster). The bare
reference of ort_trainer[+...] is ort_api with the same suffixes (same graph, same session options);
pytorch is compared with plain ort_api.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    MODELS,
    BareOrt,
    compiled_step,
    ort_trainer_step,
    print_host_stamp,
    session_options,
    set_torch_threads,
    torch_step,
)

CONTENDERS = ("pytorch", "ort_api", "ort_trainer", "ort_api+rw", "ort_trainer+rw")
BASES, SUFFIXES = ("pytorch", "compile", "ort_api", "ort_trainer"), ("+rw", "+nospin", "+spin", "+stopspin")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x 2 steps, 1 warm-up step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default: mlp 30, lm 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender after building")
    parser.add_argument("--models", default="mlp,lm", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated; {BASES} + optional suffixes {SUFFIXES} (see the module docstring)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads = ORT intra-op threads")
    parser.add_argument(
        "--spinning", choices=("default", "on", "off"), default="default", help="ORT session.intra_op.allow_spinning"
    )
    parser.add_argument("--opt-level", choices=("all", "extended", "basic", "disabled"), default="all")
    parser.add_argument("--torch-adamw", choices=("fused", "foreach", "loop"), default="fused")
    parser.add_argument("--json", help="write all timings to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    for name in args.contenders.split(","):
        base, *suffixes = name.split("+")
        if base not in BASES or any(f"+{s}" not in SUFFIXES for s in suffixes):
            parser.error(f"unknown contender {name!r}: one of {BASES}, optionally followed by {SUFFIXES}")
    return args


def build_contenders(spec, names, args):
    """name -> step function, each already built and run once on the same first batch (not timed)."""
    torch.manual_seed(0)
    model = spec.make()
    first = spec.batches(1)[0]
    default_spinning = {"default": None, "on": True, "off": False}[args.spinning]
    steps, keep = {}, []
    for name in names:
        spinning = False if "+nospin" in name else True if "+spin" in name else default_spinning
        options = session_options(args.threads, spinning, opt_level=args.opt_level, stop_spinning="+stopspin" in name)
        rewrites = "+rw" in name
        if name == "pytorch":
            steps[name] = torch_step(spec, model, args.torch_adamw)
            steps[name](first)
        elif name == "compile":
            steps[name] = compiled_step(spec, model)
            steps[name](first)
        elif name.startswith("ort_api"):
            bare = BareOrt(spec, model, options, rewrites, first)
            keep.append(bare)
            steps[name] = bare.step
        else:
            steps[name], trainer = ort_trainer_step(spec, model, options, rewrites, first)
            keep.append(trainer)
    return steps, keep


def time_model(spec, args) -> dict:
    names = args.contenders.split(",")
    n_steps = args.steps or (30 if spec.name == "mlp" else 8)
    built = time.perf_counter()
    steps, keep = build_contenders(spec, names, args)
    batches = spec.batches(4)
    second_loss = {}  # every contender took one identical step: its next loss must agree across contenders
    for name in names:
        for i in range(max(args.warmup, 1)):
            loss = steps[name](batches[i % len(batches)])
            if i == 0:
                second_loss[name] = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
    built = time.perf_counter() - built
    per_round = {name: [] for name in names}
    cpu_per_round = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            step = steps[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            for i in range(n_steps):
                step(batches[i % len(batches)])
            per_round[name].append((time.perf_counter() - start) / n_steps * 1e3)
            cpu_per_round[name].append((time.process_time() - start_cpu) / n_steps * 1e3)
    for item in keep:
        if hasattr(item, "close"):
            item.close()
    # ort_api's AdamW is the HF formula (adam_mode=1): its loss after one update differs by design
    same_rule = [v for k, v in second_loss.items() if not k.startswith("ort_api")]
    spread = max(same_rule) - min(same_rule) if same_rule else 0.0
    losses = ", ".join(f"{k} {v:.6f}" for k, v in second_loss.items())
    print(f"  loss after one update (torch-AdamW contenders agree to {spread:.1e}): {losses}", flush=True)
    return {
        "model": spec.name,
        "summary": spec.summary,
        "steps": n_steps,
        "setup_s": built,
        "second_step_loss": second_loss,
        "ms": per_round,
        "cpu_ms": cpu_per_round,
    }


def rows_for(result: dict) -> list[dict]:
    med = {name: statistics.median(v) for name, v in result["ms"].items()}
    rows = []
    for name, ms in med.items():
        bare = name.replace("ort_trainer", "ort_api") if name.startswith("ort_") else "ort_api"
        rows.append(
            {
                "model": result["model"],
                "contender": name,
                "ms_median": ms,
                "ms_min": min(result["ms"][name]),
                "cpu_ms_median": statistics.median(result["cpu_ms"][name]),
                "steps_per_s": 1e3 / ms,
                "x_pytorch": med["pytorch"] / ms if "pytorch" in med else None,
                "x_bare": med[bare] / ms if bare in med else None,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    def fmt(x, spec):
        return format("-", f">{spec.split('.')[0]}") if x is None else format(x, spec)

    header = f"{'model':5} | {'contender':18} | {'ms/step median':>14} | {'min':>7} | {'CPU ms':>7} | {'steps/s':>7} | "
    header += f"{'x PyTorch':>9} | {'x bare ORT':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:5} | {r['contender']:18} | {r['ms_median']:14.1f} | {r['ms_min']:7.1f} | "
            f"{r['cpu_ms_median']:7.1f} | "
            f"{r['steps_per_s']:7.2f} | {fmt(r['x_pytorch'], '9.3f')} | {fmt(r['x_bare'], '10.3f')}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    set_torch_threads(args.threads)
    print_host_stamp()
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = []
    for name in args.models.split(","):
        spec = MODELS[name]
        print(f"[{name}] {spec.summary}", flush=True)
        results.append(time_model(spec, args))
    rows = [row for result in results for row in rows_for(result)]
    load_after = os.getloadavg()
    print(
        f"\nthreads={args.threads} (torch.set_num_threads = ORT intra_op_num_threads, inter_op 1), "
        f"spinning={args.spinning}, ORT opt level={args.opt_level}, torch AdamW={args.torch_adamw}, "
        f"rounds={args.rounds}, warmup={args.warmup}, torch {torch.__version__}"
    )
    print(f"1-min load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} (cores: {os.cpu_count()})")
    if max(load_before[0], load_after[0]) > (os.cpu_count() or 1):
        print("WARNING: the machine is oversubscribed; absolute times are inflated and ratios noisy")
    print()
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {"args": vars(args), "loadavg": [load_before, load_after], "results": results, "rows": rows}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
