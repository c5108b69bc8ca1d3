"""Real sizes: ORTTrainer vs PyTorch on GPT-2 124M / 350M and BERT-base (and the small HF configs).

    python benchmarks/scale.py --model gpt2-124m --threads 1            # speed + memory + build, ~6 min
    python benchmarks/scale.py --model gpt2-small --threads 1 --rounds 7 --steps 3
    python benchmarks/scale.py --model bert-base --sections speed --contenders pytorch,pytorch_sdpa,ort_trainer
    python benchmarks/scale.py --model gpt2-124m --contenders pytorch,pytorch_sdpa,compile,ort_trainer,ort_api
    python benchmarks/scale.py --model gpt2-124m --threads 1 --isa avx2   # as on an AVX2 host (_isa.py)

Models (`benchmarks/_hf.py` ``SCALE_MODELS``, built from config objects, dropout 0, sequence 128):
gpt2-124m (GPT2Config defaults, batch 2), gpt2-350m (GPT-2 medium, batch 2), gpt2-774m (GPT-2 large,
batch 2), bert-base (BertConfig defaults, classifier, batch 4), gpt2-small (4 layers d 256 vocab 8000,
batch 8), bert-small (4 layers d 256, batch 16). AdamW lr 1e-3, betas 0.9/0.999, eps 1e-6, no weight
decay, no clipping, same initial weights and batches for every contender; PyTorch's AdamW is the fused
CPU kernel.

Contenders: pytorch / pytorch_sdpa (eager, ``attn_implementation`` eager / sdpa), compile
(``torch.compile`` of the model, eager attention), ort_trainer (ORTTrainer, eager attention, its
defaults), ort_trainer_shrink (with ``utils.shrink_memory_arena``), ort_trainer_keep (the legacy memory
settings: the module keeps its own weights, the arena is kept), ort_onnxblock / ort_autograd (ORTTrainer
with each engine by name; ort_autograd builds with an empty graph cache, ort_autograd_warm after it from
the cache it filled, as a resumed job does), ort_api (the bare
``onnxruntime.training.api`` loop on the same graph and rewrites), ortmodule (``ORTModule(model)`` in the
eager loop: forward and backward graphs in ONNX Runtime, torch's fused AdamW) and compile_ort
(``torch.compile(model, backend="ort_trainer")``, the same loop); their memory children start with an empty
graph cache (a cold build). Threads:
``torch.set_num_threads(--threads)`` = ORT intra-op threads; without --threads, each library's default
(ORTTrainer: one thread per core).

Sections (--sections, default all three):
* speed: every contender built in this one process, then --rounds rounds of --steps steps each, the
  order reversed every other round; ms/step = median over rounds of the round mean. "CPU ms" is the
  process CPU time per step: at 1 thread it is the compute itself, robust to other processes on a
  loaded machine (wall time is not). "x best eager" = the faster of pytorch/pytorch_sdpa over the
  contender (> 1: faster than PyTorch).
* memory: each contender alone in a child process (this script with --child): peak RSS over the whole
  process (build included) and steady RSS after the timed steps, MiB, and the ratio to the best eager.
* build: (from the memory children) seconds of the first step (ORTTrainer: export + gradient graph +
  sessions + the step) and that time in steps of PyTorch eager.
Every table is stamped with the host (`_common.host_stamp`): read ratios, not absolute times.
``--isa avx2`` re-runs the script with CPUID masked (`benchmarks/_isa.py`): every library, in this process
and in the memory children, takes its AVX2 kernels; cores, caches and clocks stay this machine's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BareOrt,
    compiled_step,
    host_stamp,
    ort_trainer_step,
    session_options,
    status_kb,
    torch_step,
    wrapped_step,
)
from benchmarks._hf import SCALE_MODELS, scale_spec
from benchmarks._isa import add_isa_argument, use_isa
from ort_trainer.config import ORTTrainerOptions
from ort_trainer.engine._build import session_options_for  # the session options ORTTrainer makes itself

CONTENDERS = (
    "pytorch",
    "pytorch_sdpa",
    "compile",
    "ort_trainer",
    "ort_trainer_shrink",
    "ort_trainer_keep",
    "ort_trainer_pattern",
    "ort_trainer_nopattern",
    "ort_onnxblock",
    "ort_autograd",
    "ort_autograd_warm",
    "ort_api",
    "ortmodule",
    "compile_ort",
)
# ORTTrainer variants: its defaults, and each memory setting forced on / off
ORT_TRAINER_UTILS = {
    "ort_trainer": {},
    "ort_trainer_shrink": {"shrink_memory_arena": True},
    "ort_trainer_keep": {"shrink_memory_arena": False, "share_module_parameters": False},
    "ort_trainer_pattern": {},  # ONNX Runtime's memory pattern on (session option)
    "ort_trainer_nopattern": {},  # and off
    "ort_onnxblock": {"engine": "onnxblock"},  # the engines by name (ort_trainer: "auto")
    "ort_autograd": {"engine": "autograd"},  # its graph cache emptied first: a cold build
    "ort_autograd_warm": {"engine": "autograd"},  # the same cache, filled by ort_autograd: a resume's build
}
# the autograd contenders' graph cache: one folder per run of this script, shared by its children
_CACHE_ENV = "ORT_TRAINER_GRAPH_CACHE_DIR"
DEFAULT_CONTENDERS = "pytorch,pytorch_sdpa,ort_trainer"
SECTIONS = ("speed", "memory", "build")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(SCALE_MODELS))
    parser.add_argument("--batch", type=int, default=None, help="sequences of 128 tokens (default: the model's)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"comma-separated from {CONTENDERS}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated from {SECTIONS}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--mem-steps", type=int, default=3, help="steps each memory child runs after its build")
    parser.add_argument("--threads", type=int, default=None, help="torch threads = ORT intra-op (default: each's)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", metavar="CONTENDER", help=argparse.SUPPRESS)
    add_isa_argument(parser)
    args = parser.parse_args(argv)
    for name in args.contenders.split(","):
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r}; choose from {CONTENDERS}")
    for name in args.sections.split(","):
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; choose from {SECTIONS}")
    return args


def build(name: str, args) -> tuple:
    """(step function, object to keep alive, seconds of the build + first step)."""
    spec = scale_spec(args.model, args.batch, "sdpa" if name.endswith("_sdpa") else "eager")
    torch.manual_seed(0)
    model = spec.make()
    first = spec.batches(1)[0]
    start = time.perf_counter()
    keep = None
    if name.startswith("pytorch"):
        step = torch_step(spec, model, copy_model=False)
    elif name == "compile":
        step = compiled_step(spec, model, copy_model=False)
    elif name == "compile_ort":
        step = compiled_step(spec, model, copy_model=False, backend="ort_trainer")
    elif name == "ortmodule":
        from ort_trainer import ORTModule

        step = wrapped_step(spec, model, ORTModule, copy_model=False)
    elif name in ORT_TRAINER_UTILS:
        options = None
        if args.threads is not None or name.endswith("pattern"):
            options = session_options_for(ORTTrainerOptions({}))  # ORTTrainer's own defaults, then:
            options.intra_op_num_threads = args.threads or 0
        if name.endswith("pattern"):
            options.enable_mem_pattern = name == "ort_trainer_pattern"
        step, keep = ort_trainer_step(spec, model, options, True, first, ORT_TRAINER_UTILS[name], copy_model=False)
    else:
        keep = BareOrt(
            spec, model, session_options(args.threads or torch.get_num_threads(), spinning=False), True, first
        )
        step = keep.step
    if name not in ORT_TRAINER_UTILS and name != "ort_api":
        step(first)  # the ORTTrainer contenders ran their first step while building
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    return step, keep, seconds


def run_speed(args) -> dict:
    names = args.contenders.split(",")
    batches = scale_spec(args.model, args.batch).batches(3)
    steps, keep, built = {}, [], {}
    for name in names:
        steps[name], obj, built[name] = build(name, args)
        keep.append(obj)
        for i in range(args.warmup):
            steps[name](batches[i % len(batches)])
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start, start_cpu = time.perf_counter(), time.process_time()
            for i in range(args.steps):
                steps[name](batches[i % len(batches)])
            wall[name].append((time.perf_counter() - start) / args.steps * 1e3)
            cpu[name].append((time.process_time() - start_cpu) / args.steps * 1e3)
    for obj in keep:
        if hasattr(obj, "close"):
            obj.close()
    return {
        name: {"ms": statistics.median(wall[name]), "min": min(wall[name]), "cpu_ms": statistics.median(cpu[name])}
        for name in names
    }


def print_speed(rows: dict) -> None:
    eager = [rows[n] for n in ("pytorch", "pytorch_sdpa") if n in rows]
    best = min((r["ms"] for r in eager), default=None)
    best_cpu = min((r["cpu_ms"] for r in eager), default=None)
    compiled, bare = rows.get("compile"), rows.get("ort_api")
    print("| contender | ms/step median | min | CPU ms/step | × best eager | × best eager (CPU) | × compile | × bare |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        ratio = [best / row["ms"] if best else None, best_cpu / row["cpu_ms"] if best_cpu else None]
        ratio.append(compiled["ms"] / row["ms"] if compiled else None)
        ratio.append(bare["ms"] / row["ms"] if bare else None)
        cells = " | ".join("–" if x is None else f"{x:.2f}" for x in ratio)
        print(f"| {name} | {row['ms']:.1f} | {row['min']:.1f} | {row['cpu_ms']:.1f} | {cells} |", flush=True)


def child(args) -> None:
    """Build one contender alone, run --mem-steps steps; print its build time and RSS as JSON."""
    if args.child == "ort_autograd" and os.environ.get(_CACHE_ENV):
        shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)  # a cold build: nothing cached
    if args.child in ("ortmodule", "compile_ort"):  # a cold build in a folder of its own (ort_autograd_warm's stays)
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="scale_graph_cache_")
    step, keep, seconds = build(args.child, args)
    batches = scale_spec(args.model, args.batch).batches(2)
    times = []
    for i in range(args.mem_steps):
        start = time.perf_counter()
        step(batches[i % 2])
        times.append(time.perf_counter() - start)
    gc.collect()
    result = {"build_s": seconds, "step_s": statistics.median(times)}
    result |= {"peak": status_kb("VmHWM"), "steady": status_kb("VmRSS")}
    print("RESULT " + json.dumps(result), flush=True)
    del keep


def run_children(args) -> dict:
    results = {}
    for name in args.contenders.split(","):
        command = [sys.executable, __file__, "--child", name, "--model", args.model, "--mem-steps", str(args.mem_steps)]
        command += ["--batch", str(args.batch)] if args.batch else []
        command += ["--threads", str(args.threads)] if args.threads else []
        command += ["--isa", args.isa]  # the child inherits LD_PRELOAD; use_isa checks the shim is there
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{name}: child failed (exit {done.returncode}): {done.stderr.strip()[-400:]}", flush=True)
            continue
        results[name] = json.loads(lines[-1].removeprefix("RESULT "))
    return results


def print_memory(results: dict) -> None:
    eager = [results[n] for n in ("pytorch", "pytorch_sdpa") if n in results]
    best_peak = min((r["peak"] for r in eager), default=None)
    best_steady = min((r["steady"] for r in eager), default=None)
    print("| contender | peak RSS MiB | steady RSS MiB | peak × best eager | steady × best eager |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        peak = f"{r['peak'] / best_peak:.2f}" if best_peak else "–"
        steady = f"{r['steady'] / best_steady:.2f}" if best_steady else "–"
        print(f"| {name} | {r['peak'] / 1024:.0f} | {r['steady'] / 1024:.0f} | {peak} | {steady} |", flush=True)


def print_build(results: dict) -> None:
    step = results.get("pytorch", {}).get("step_s")
    print("| contender | first step s (build + step) | later step s | first step ÷ PyTorch eager step |")
    print("|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{r['build_s'] / step:.1f}" if step else "–"
        print(f"| {name} | {r['build_s']:.1f} | {r['step_s']:.2f} | {ratio} |", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    use_isa(args.isa)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return 0
    sections = args.sections.split(",")
    os.environ.setdefault(_CACHE_ENV, tempfile.mkdtemp(prefix="scale_graph_cache_"))  # never the user's cache
    spec = scale_spec(args.model, args.batch)
    print(host_stamp())
    print(
        f"model: {spec.summary}; torch threads {torch.get_num_threads()}; {args.rounds} rounds x {args.steps} steps\n"
    )
    report: dict = {"host": host_stamp(), "model": spec.summary}
    if "speed" in sections:
        report["speed"] = run_speed(args)
        print_speed(report["speed"])
        gc.collect()
    if "memory" in sections or "build" in sections:
        report["children"] = run_children(args)
        if "memory" in sections:
            print(f"\nmemory, each contender alone in a process ({args.mem_steps} steps after the build)")
            print_memory(report["children"])
        if "build" in sections:
            print("\nbuild time (from the same processes)")
            print_build(report["children"])
    print(f"\nend: {host_stamp().splitlines()[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
