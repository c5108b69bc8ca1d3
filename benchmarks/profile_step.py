"""Where an ORTTrainer LM training step spends its time, next to PyTorch eager's profile.

    python benchmarks/profile_step.py                 # LM, 2 threads, graph with and without rewrites
    python benchmarks/profile_step.py --rewrites off --steps 8 --top 15
    python benchmarks/profile_step.py --model gpt2 --rewrites on    # HF GPT-2 (or bert), benchmarks/_hf.py

ONNX Runtime side: the training session runs with ``SessionOptions.enable_profiling``; its JSON trace
is parsed (``cat == "Node"`` kernel events after the warm-up runs) and kernel time is summed by op
type and by node. The step is also split into ORT's own ``model_run`` time, the optimizer update and
what is left (the Python frontend: input binding, output wrapping, bookkeeping).
PyTorch side: ``torch.profiler`` over the same number of eager steps, ops by self CPU time.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    MODELS,
    ort_trainer_step,
    print_host_stamp,
    session_options,
    set_torch_threads,
    torch_step,
)
from benchmarks._hf import SCALE_MODELS, bert_spec, gpt2_spec, scale_spec

SPECS = {**MODELS, "gpt2": gpt2_spec(), "bert": bert_spec(), **{n: scale_spec(n) for n in SCALE_MODELS}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lm", choices=sorted(SPECS))
    parser.add_argument("--threads", type=int, default=2, help="torch threads = ORT intra-op threads")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--rewrites", choices=("off", "on", "both"), default="both")
    parser.add_argument(
        "--spinning",
        choices=("default", "on", "off", "stop"),
        default="default",
        help="ORT intra-op spinning; stop: session.force_spinning_stop=1 (spin only inside Run)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch profile")
    parser.add_argument(
        "--engine",
        default="auto",
        choices=("auto", "onnxblock", "autograd", "both"),
        help="the ORTTrainer engine(s) to profile (both: side by side; needs onnxruntime-training)",
    )
    parser.add_argument("--json", help="write the aggregated profiles to this file")
    return parser.parse_args(argv)


def _timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    return wrapper


def _train_session(session):
    """The ONNX Runtime session that runs training steps, for either engine's session object."""
    train = session._train
    return next(reversed(train.values())).session if isinstance(train, dict) else train


def profile_ort(spec, model, args, rewrites: bool, engine_name: str = "auto") -> dict:
    folder = tempfile.mkdtemp(prefix="ort_profile_")
    spinning = {"default": None, "on": True, "off": False, "stop": None}[args.spinning]
    try:
        options = session_options(
            args.threads, spinning, profile_prefix=str(Path(folder) / "train"), stop_spinning=args.spinning == "stop"
        )
        batches = spec.batches(4)
        utils = None if engine_name == "auto" else {"engine": engine_name}
        step, trainer = ort_trainer_step(spec, model, options, rewrites, batches[0], utils)
        for i in range(args.warmup):
            step(batches[i % len(batches)])
        engine = trainer.trainer_state.engine  # the benchmark reaches into the engine to time its two halves
        run_times, update_times, step_times = [], [], []
        engine.session.run_train = _timed(engine.session.run_train, run_times)
        engine.optimizer.step = _timed(engine.optimizer.step, update_times)
        for i in range(args.steps):
            start = time.perf_counter()
            step(batches[i % len(batches)])
            step_times.append(time.perf_counter() - start)
        trace = json.loads(Path(_train_session(engine.session).end_profiling()).read_text())
        result = summarize_ort_trace(trace, skip_runs=1 + args.warmup, steps=args.steps, top=args.top)
        runs = result.pop("model_run_each_ms")
        frontend = [
            (wall - update) * 1e3 - run for wall, update, run in zip(step_times, update_times, runs, strict=True)
        ]
        result["breakdown_ms"] = {  # medians over the profiled steps
            "step_wall": statistics.median(step_times) * 1e3,
            "ort_model_run": statistics.median(runs),
            "run_train_call": statistics.median(run_times) * 1e3,
            "optimizer": statistics.median(update_times) * 1e3,
            "frontend_rest": statistics.median(frontend),
        }
        del engine, trainer, step
        gc.collect()  # the eval session writes its (empty) profile on destruction: inside `folder`
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summarize_ort_trace(trace: list, skip_runs: int, steps: int, top: int) -> dict:
    runs = [e for e in trace if e.get("name") == "model_run"]
    timed = runs[skip_runs : skip_runs + steps]
    if not timed:
        raise RuntimeError(f"the ORT trace has {len(runs)} model_run events; expected more than {skip_runs}")
    first, last = timed[0]["ts"], timed[-1]["ts"] + timed[-1]["dur"]
    by_op, by_node, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for event in trace:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if not first <= event["ts"] <= last:
            continue
        op = event["args"]["op_name"]
        by_op[op] += event["dur"]
        calls[op] += 1
        by_node[(op, event["name"].removesuffix("_kernel_time"))] += event["dur"]
    n = len(timed)
    kernels = sum(by_op.values()) / n / 1e3
    return {
        "model_run_ms": statistics.median(e["dur"] for e in timed) / 1e3,
        "model_run_each_ms": [e["dur"] / 1e3 for e in timed],
        "kernel_ms": kernels,
        "ops": [(op, us / n / 1e3, calls[op] // n) for op, us in by_op.most_common(top)],
        "nodes": [(f"{op} {name}", us / n / 1e3) for (op, name), us in by_node.most_common(top)],
        "all_nodes": {f"{op} {name}": us / n / 1e3 for (op, name), us in by_node.items()},
    }


def profile_torch(spec, model, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step = torch_step(spec, model, "fused")
    batches = spec.batches(4)
    for i in range(1 + args.warmup):
        step(batches[i % len(batches)])
    wall = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            start = time.perf_counter()
            step(batches[i % len(batches)])
            wall.append(time.perf_counter() - start)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3
    return {
        "step_wall_ms": statistics.median(wall) * 1e3,
        "self_cpu_ms": total,
        "ops": [(e.key, e.self_cpu_time_total / args.steps / 1e3, e.count // args.steps) for e in events[: args.top]],
    }


FOCUS_OPS = (
    "GatherGrad",
    "GatherNDGrad",
    "SoftmaxCrossEntropyLoss",
    "SoftmaxCrossEntropyLossGrad",
    "LogSoftmax",
    "LogSoftmaxGrad_13",
    "GatherElementsGrad",
    "GeluGrad",
    "BiasGeluGrad_dX",
    "FastGeluGrad",
    "BiasFastGeluGrad_dX",
)


def print_focus(result: dict) -> None:
    """Per-node times of the ops DESIGN.md blames (and of what the rewrites put in their place).

    Gradient-accumulation ``Sum`` nodes are not included.
    """
    rows = [
        (name, ms)
        for name, ms in result["all_nodes"].items()
        if name.split(" ", 1)[0] in FOCUS_OPS or " sce/" in name or " gelu_grad/" in name  # our rewrites' nodes
    ]
    if not rows:
        return
    print(f"\nembedding/loss/GELU-gradient nodes ({sum(ms for _, ms in rows):.1f} ms/step in all)")
    for name, ms in sorted(rows, key=lambda r: -r[1])[:12]:
        print(f"  {name[:100]:100} {ms:8.1f}")


def print_ops(title: str, ops, total: float) -> None:
    print(f"\n{title}")
    print(f"  {'op':58} {'ms/step':>8} {'share':>6} {'calls':>6}")
    for op, ms, count in ops:
        print(f"  {op[:58]:58} {ms:8.1f} {ms / total:6.1%} {count:6d}")


def main(argv=None) -> int:
    args = parse_args(argv)
    set_torch_threads(args.threads)
    spec = SPECS[args.model]
    torch.manual_seed(0)
    model = spec.make()
    print_host_stamp()
    print(f"{spec.summary}; threads={args.threads}, {args.steps} profiled steps after {args.warmup} warm-up")
    report = {}
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.rewrites]
    engines = ["onnxblock", "autograd"] if args.engine == "both" else [args.engine]
    for engine_name, rewrites in ((e, r) for e in engines for r in variants):
        if engine_name == "autograd" and rewrites and len(variants) > 1:
            continue  # the rewrites are the onnxblock graph's; the autograd graph is PyTorch's own formulas
        label = "ORTTrainer" + (f" ({engine_name} engine)" if engine_name != "auto" else "")
        label += " + graph rewrites" if rewrites and engine_name != "autograd" else ""
        result = profile_ort(spec, model, args, rewrites, engine_name)
        report[label] = result
        b = result["breakdown_ms"]
        print(
            f"\n== {label}: step {b['step_wall']:.1f} ms = ORT model_run {b['ort_model_run']:.1f} "
            f"(kernels {result['kernel_ms']:.1f}) + optimizer {b['optimizer']:.1f} "
            f"+ frontend {b['frontend_rest']:.2f} ms ({b['frontend_rest'] / b['step_wall']:.2%}) [medians]"
        )
        print_ops(f"top {args.top} ORT ops (kernel time summed per op type)", result["ops"], result["kernel_ms"])
        print(f"\ntop {args.top} ORT nodes")
        for name, ms in result["nodes"]:
            print(f"  {name[:100]:100} {ms:8.1f}")
        print_focus(result)
    if not args.no_torch:
        result = profile_torch(spec, model, args)
        report["pytorch"] = result
        print(
            f"\n== PyTorch eager: step {result['step_wall_ms']:.1f} ms (profiled), "
            f"op self time {result['self_cpu_ms']:.1f} ms"
        )
        print_ops(f"top {args.top} PyTorch ops (self CPU time)", result["ops"], result["self_cpu_ms"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
