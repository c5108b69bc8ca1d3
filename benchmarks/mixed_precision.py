"""Steps/s and peak memory of ORTTrainer with mixed precision on vs off (CPU; CUDA when available).

Each configuration runs in its own subprocess so that peak RSS (ru_maxrss) belongs to it alone.
On the CPU execution provider the fp16 probe finds no fp16 arithmetic kernels, so "fp16" there is the
fp32 graph plus loss scaling: the table shows what that costs. ``--force-fp16`` marks every op as
fp16-capable (what a CUDA provider reports) to measure the cast-heavy graph on CPU (the onnxblock engine's
converted graph; the autograd engine's autocast graph). On ``--device cuda`` with onnxruntime-gpu the
autograd engine's fp16/bf16 graphs run on the CUDA provider's kernels: that is the measurement a GPU gives.

    python benchmarks/mixed_precision.py [--steps 30] [--device cpu|cuda] [--force-fp16]
        [--engine auto|onnxblock|autograd] [--dtype float16|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _child(args) -> None:
    sys.path.insert(0, str(REPO))
    import ort_trainer.engine.autograd._precision as autograd_precision
    import ort_trainer.engine.onnxblock._build as build
    from ort_trainer import ORTTrainer, optim
    from tests.models import LM_DESC, TinyLM, lm_batches, lm_loss

    torch.set_num_threads(2)
    if args.force_fp16:
        build.provider_fp16_support = lambda providers, ops: dict.fromkeys(((d, o) for d, o, *_ in ops), True)
        autograd_precision.low_precision_support = lambda providers, ops, elem: {(d, o): True for d, o, *_ in ops}
    options = {"device": {"id": args.device}, "utils": {"engine": args.engine}}
    if args.mixed:
        options["mixed_precision"] = {"enabled": True, "dtype": args.dtype}
    torch.manual_seed(0)
    model = TinyLM(vocab=2000, d_model=256, layers=2, heads=4)
    trainer = ORTTrainer(model, LM_DESC, optim.AdamConfig(lr=1e-4), loss_fn=lm_loss, options=options)
    batches = lm_batches(args.steps + 3, batch=8, seq=128, vocab=2000)
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        trainer.train_step(*batch).item()
        if i >= 3:  # warm-up (export + graph build) excluded
            times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"ms": statistics.median(times) * 1e3, "peak_mb": peak_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--force-fp16", action="store_true")
    parser.add_argument("--engine", default="auto", choices=["auto", "onnxblock", "autograd"])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--mixed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    from benchmarks._common import print_host_stamp  # here: worker processes must not import it

    print_host_stamp()
    rows = []
    for mixed in (False, True):
        cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--device", args.device]
        cmd += ["--engine", args.engine, "--dtype", args.dtype]
        cmd += ["--mixed"] * mixed + ["--force-fp16"] * args.force_fp16
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append((f"{args.dtype} (mixed precision)" if mixed else "fp32", json.loads(out)))
    base = rows[0][1]["ms"]
    print(
        f"\nTinyLM vocab 2000, d_model 256, 2 layers, batch 8 x 128 on {args.device}, engine {args.engine}"
        f"{' (all ops forced fp16)' if args.force_fp16 else ''}; median of {args.steps} steps"
    )
    print("| precision | ms/step | steps/s | vs fp32 | peak RSS MB |\n|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['ms']:.1f} | {1e3 / r['ms']:.2f} | {base / r['ms']:.2f}x | {r['peak_mb']:.0f} |")


if __name__ == "__main__":
    main()
