"""Training step of Hugging Face GPT-2 and BERT: ORTTrainer vs PyTorch eager vs torch.compile vs bare ORT.

    python benchmarks/hf_models.py                          # GPT-2 + BERT table (~6 min on a quiet 2-core box)
    python benchmarks/hf_models.py --models gpt2 --contenders pytorch,ort_trainer --rounds 7
    python benchmarks/hf_models.py --scaling                # GPT-2 at 2/4/8 layers x batch 4/8/16 vs eager
    python benchmarks/hf_models.py --memory                 # peak RSS of the training steps, one process each

Models: see `benchmarks/_hf.py` (built from config objects, dropout 0, attention mask given). Every
contender starts from the same weights and trains with AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-6, no
weight decay, no clipping) on the same batches.

Contenders:
  pytorch          eager PyTorch, ``attn_implementation="eager"`` (the attention ORTTrainer's graph has)
  pytorch_sdpa     eager PyTorch with ``scaled_dot_product_attention`` (transformers' default)
  compile          ``torch.compile(model)`` (inductor, default mode), eager attention; optimizer eager
  compile_sdpa     the same with sdpa
  ort_trainer      ORTTrainer with its defaults (no session_options given), eager attention
  ort_api          the bare onnxruntime.training.api loop (Module + Optimizer, AdamW) on the same graph,
                   ORT intra-op spinning off like ORTTrainer's default
PyTorch's AdamW is the fused CPU kernel. Threads: torch.set_num_threads(--threads); ORTTrainer uses ORT's
default intra-op pool (one thread per physical core) unless --threads is given explicitly.

Method: build and warm up every contender (not timed), then --rounds rounds; in each round every
contender runs --steps steps, the order alternating between rounds. ms/step = median over rounds of the
round mean. "x eager" = pytorch's ms / contender's ms (> 1: faster than eager PyTorch with the same
attention); "x best eager" uses the faster of pytorch and pytorch_sdpa when both ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BareOrt,
    compiled_step,
    ort_trainer_step,
    print_host_stamp,
    session_options,
    status_kb,
    torch_step,
)
from benchmarks._hf import bert_spec, gpt2_spec

CONTENDERS = ("pytorch", "pytorch_sdpa", "compile", "ort_trainer", "ort_api")
KNOWN = (*CONTENDERS, "compile_sdpa")
SPECS = {"gpt2": gpt2_spec, "bert": bert_spec}
DEFAULT_BATCH = {"gpt2": 8, "bert": 16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated from {KNOWN}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="default: gpt2 8, bert 16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's) = ORT intra-op")
    parser.add_argument("--scaling", action="store_true", help="GPT-2 at 2/4/8 layers x batch 4/8/16 vs eager")
    parser.add_argument("--memory", action="store_true", help="peak RSS of the steps, one process per contender")
    parser.add_argument("--rss-child", nargs=2, metavar=("MODEL", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.contenders.split(","):
        if name not in KNOWN:
            parser.error(f"unknown contender {name!r}; choose from {KNOWN}")
    for name in args.models.split(","):
        if name not in SPECS:
            parser.error(f"unknown model {name!r}; choose from {sorted(SPECS)}")
    return args


def build(spec_for, model_name: str, name: str, args) -> tuple:
    """(step function, objects to keep alive); built and run once on the first batch, not timed."""
    attn = "sdpa" if name.endswith("_sdpa") else "eager"
    spec = spec_for(attn)
    torch.manual_seed(0)
    model = spec.make()
    first = spec.batches(1)[0]
    if name.startswith("pytorch"):
        step = torch_step(spec, model)
    elif name.startswith("compile"):
        step = compiled_step(spec, model)
    elif name == "ort_trainer":
        options = None if args.threads is None else session_options(args.threads, spinning=False)
        step, trainer = ort_trainer_step(spec, model, options, True, first)
        return step, trainer
    else:
        # spinning off, as ORTTrainer's default: spinning pool threads linger after a run and would slow
        # whichever contender runs next in this process
        bare = BareOrt(spec, model, session_options(args.threads or _physical_cores(), spinning=False), True, first)
        return bare.step, bare
    step(first)
    return step, None


def _physical_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def time_contenders(model_name: str, spec_for, names: list[str], args) -> dict[str, list[float]]:
    steps, keep = {}, []
    batches = spec_for("eager").batches(4)
    for name in names:
        steps[name], obj = build(spec_for, model_name, name, args)
        keep.append(obj)
        for i in range(args.warmup):
            steps[name](batches[i % len(batches)])
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            start = time.perf_counter()
            for i in range(args.steps):
                steps[name](batches[i % len(batches)])
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    for obj in keep:
        if hasattr(obj, "close"):
            obj.close()
    return times


def ratios(times: dict[str, list[float]]) -> dict[str, dict]:
    med = {name: statistics.median(v) for name, v in times.items()}
    eager = med.get("pytorch")
    best = min(v for k, v in med.items() if k in ("pytorch", "pytorch_sdpa")) if eager else None
    return {
        name: {
            "ms": ms,
            "min": min(times[name]),
            "x_eager": eager / ms if eager else None,
            "x_best": best / ms if best and "pytorch_sdpa" in med else None,
        }
        for name, ms in med.items()
    }


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def run_table(args) -> None:
    names = args.contenders.split(",")
    print("| model | contender | ms/step median | min | × eager | × best eager |")
    print("|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        batch = args.batch or DEFAULT_BATCH[model_name]

        def spec_for(attn, model_name=model_name, batch=batch):
            return SPECS[model_name](args.layers, batch, attn)

        rows = ratios(time_contenders(model_name, spec_for, names, args))
        for name, row in rows.items():
            print(
                f"| {model_name} {args.layers}L b{batch} | {name} | {row['ms']:.1f} | {row['min']:.1f} | "
                f"{_fmt(row['x_eager'])} | {_fmt(row['x_best'])} |",
                flush=True,
            )


def run_scaling(args) -> None:
    names = [n for n in args.contenders.split(",") if n in ("pytorch", "pytorch_sdpa", "ort_trainer")]
    print(f"GPT-2 scaling, contenders {names}: ORTTrainer speed vs eager PyTorch (ms/step medians)\n")
    print("| layers | batch | pytorch ms | ort_trainer ms | × eager | × best eager |")
    print("|---|---|---|---|---|---|")
    for layers in (2, 4, 8):
        for batch in (4, 8, 16):

            def spec_for(attn, layers=layers, batch=batch):
                return gpt2_spec(layers, batch, attn)

            rows = ratios(time_contenders("gpt2", spec_for, names, args))
            ort = rows["ort_trainer"]
            print(
                f"| {layers} | {batch} | {rows['pytorch']['ms']:.1f} | {ort['ms']:.1f} | {_fmt(ort['x_eager'])} | "
                f"{_fmt(ort['x_best'])} |",
                flush=True,
            )


def rss_child(args) -> None:
    """Build one contender, then report the peak RSS over the measured steps (VmHWM reset first)."""
    model_name, name = args.rss_child
    batch = args.batch or DEFAULT_BATCH[model_name]

    def spec_for(attn):
        return SPECS[model_name](args.layers, batch, attn)

    step, keep = build(spec_for, model_name, name, args)
    batches = spec_for("eager").batches(2)
    step(batches[1])
    before = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    for i in range(args.steps):
        step(batches[i % 2])
    print(f"RSS {before} {status_kb('VmHWM')} {status_kb('RssAnon')} {status_kb('RssFile')}")
    del keep


def run_memory(args) -> None:
    print("| model | contender | RSS before the steps (MiB) | peak RSS during the steps | anonymous | file-backed |")
    print("|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for name in args.contenders.split(","):
            command = [sys.executable, __file__, "--rss-child", model_name, name, "--layers", str(args.layers)]
            command += ["--steps", str(args.steps)] + (["--batch", str(args.batch)] if args.batch else [])
            command += ["--threads", str(args.threads)] if args.threads else []
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            before, peak, anon, files = (int(x) / 1024 for x in out.split("RSS ")[-1].split())
            print(f"| {model_name} | {name} | {before:.0f} | {peak:.0f} | {anon:.0f} | {files:.0f} |", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args)
        return 0
    load = os.getloadavg()[0]
    started = time.perf_counter()
    print_host_stamp()
    print(
        f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, rounds {args.rounds} x {args.steps} "
        f"steps, 1-min load {load:.2f} on {os.cpu_count()} cores\n"
    )
    if args.memory:
        run_memory(args)
    elif args.scaling:
        run_scaling(args)
    else:
        run_table(args)
    print(f"\n1-min load after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
