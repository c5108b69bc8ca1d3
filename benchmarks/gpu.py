"""ORTTrainer's autograd engine on a CUDA GPU (onnxruntime-gpu's CUDA EP) against eager PyTorch on the same GPU.

    python benchmarks/gpu.py                                   # every section, GPT-2 124M batch 8 x 128
    python benchmarks/gpu.py --sections zoo
    python benchmarks/gpu.py --sections sync,speed,memory --model gpt2-350m --batch 8

Sections (--sections, default all):
* zoo: every architecture of ``tests/zoo`` (tiny configs), 5 AdamW steps on ORT (autograd engine, CUDA EP) and
  in eager PyTorch on the GPU from the same weights and batches; the largest loss and weight differences. TF32
  is off on both sides (``use_tf32=0``; torch's matmul precision "highest", cuDNN TF32 off), so both compute
  in fp32; the kernels (cuBLAS algorithms, atomics in reductions) still differ, so the tolerance is looser
  than on the CPU.
* sync: one training step under ``torch.cuda.set_sync_debug_mode("error")`` (any torch op that waits for the
  GPU raises), with and without gradient clipping; the ``Memcpy`` nodes ONNX Runtime put into the optimized
  training graph (each is a host round trip inside a run) and the nodes it left on the CPU EP.
* speed: every contender built in this process, then --rounds interleaved rounds of --steps steps,
  ``_sync()`` at the end of each round; ms/step = median of the round means. "host ms" is
  the time the Python call takes (a step that does not wait for the GPU returns before its kernels ran).
  Contenders: pytorch / pytorch_sdpa (eager, eager / sdpa attention, fused AdamW), ort_autograd (ORTTrainer,
  autograd engine), each in strict fp32; the ``_tf32`` variants let both sides use TF32 matmuls (torch
  ``set_float32_matmul_precision("high")``; ORT's CUDA EP default ``use_tf32=1``).
* memory: each contender alone in a child process: the device memory the process holds after the build and
  --mem-steps steps (``torch.cuda.mem_get_info``, CUDA context excluded: read before the model is built), and
  torch's own peak (``max_memory_allocated``; ORT's arena is not in it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import BETAS, EPS, LR, WEIGHT_DECAY, torch_step
from benchmarks._hf import SCALE_MODELS, scale_spec
from ort_trainer import ORTTrainer, optim

SECTIONS = ("sync", "speed", "zoo", "memory")
CONTENDERS = ("pytorch", "pytorch_sdpa", "ort_autograd", "pytorch_sdpa_tf32", "ort_autograd_tf32", "ort_autograd_pow2")
ZOO_STEPS, ZOO_LR, ZOO_DECAY, ZOO_EPS = 5, 1e-3, 0.01, 1e-5  # tests/zoo/test_zoo.py's


_DEVICE = "cuda"  # --device cpu: a dry run of this script on a machine without a GPU


def _sync() -> None:
    if _DEVICE == "cuda":
        torch.cuda.synchronize()


def _strict_fp32(tf32: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


def _ort_options(tf32: bool, clip: bool = False, session_options=None, arena: str | None = None) -> dict:
    cuda = {"use_tf32": "1" if tf32 else "0"}
    if arena:  # ORTTrainer's default is kSameAsRequested; _pow2: ORT's own default, kNextPowerOfTwo
        cuda["arena_extend_strategy"] = arena
    options = {
        "device": {"id": "cuda:0" if _DEVICE == "cuda" else "cpu"},
        "utils": {"grad_norm_clip": clip, "engine": "autograd"},
        "provider_options": {"CUDAExecutionProvider": cuda},
    }
    if session_options is not None:
        options["session_options"] = session_options
    return options


def _on_gpu(batch) -> tuple:
    return tuple(t.to(_DEVICE) for t in batch)


def host_stamp() -> str:
    import onnxruntime as ort

    if _DEVICE != "cuda":
        return f"DRY RUN on the CPU (--device cpu); torch {torch.__version__}, onnxruntime {ort.__version__}"
    props = torch.cuda.get_device_properties(0)
    return "\n".join(
        [
            f"gpu: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
            f"driver CUDA {torch.version.cuda}; host cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}",
            f"versions: python {sys.version.split()[0]}, torch {torch.__version__}, onnxruntime {ort.__version__} "
            f"({', '.join(ort.get_available_providers())})",
            f"command: {' '.join([Path(sys.executable).name, *sys.argv])}",
        ]
    )


# ---------------------------------------------------------------------------------------------------- zoo
def run_zoo(args) -> list[dict]:
    from tests.zoo.architectures import ARCHITECTURES
    from tests.zoo.test_zoo import AUTOGRAD_REFUSED

    _strict_fp32(False)
    rows = []
    for name in sorted(ARCHITECTURES):
        if args.zoo_archs and name not in args.zoo_archs.split(","):
            continue
        if name in AUTOGRAD_REFUSED:
            rows.append({"arch": name, "status": "refused on every device (docs/engines.md)"})
            continue
        start = time.perf_counter()
        try:
            rows.append({"arch": name, **_zoo_row(ARCHITECTURES[name]()), "s": time.perf_counter() - start})
        except Exception as error:  # noqa: BLE001 - a row per architecture; the report names the failure
            rows.append({"arch": name, "status": f"FAILED: {type(error).__name__}: {str(error)[:300]}"})
            traceback.print_exc()
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _zoo_row(arch) -> dict:
    g = torch.Generator().manual_seed(1)
    batches = [_on_gpu(arch.batch(g)) for _ in range(ZOO_STEPS)]
    torch.manual_seed(0)
    model = arch.build().to(_DEVICE)
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(
        model,
        arch.desc,
        optim.AdamConfig(lr=ZOO_LR, lambda_coef=ZOO_DECAY, epsilon=ZOO_EPS),
        options={**_ort_options(False), "debug": {"deterministic_compute": True}},
    )
    losses = [trainer.train_step(*batch).item() for batch in batches]
    opt = torch.optim.AdamW(reference.parameters(), lr=ZOO_LR, weight_decay=ZOO_DECAY, eps=ZOO_EPS)
    names = [n for n, _ in arch.inputs]
    reference.train()
    expected = []
    for batch in batches:
        opt.zero_grad()
        loss = reference(**dict(zip(names, batch, strict=True)))[0]
        loss.backward()
        opt.step()
        expected.append(loss.item())
    weights = trainer.state_dict(pytorch_format=True)
    diffs = [
        (float((weights[k].to(v.device) - v).abs().max()), k) for k, v in reference.state_dict().items() if k in weights
    ]
    worst = max(diffs)
    return {
        "status": "ok",
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected, strict=True)),
        "loss_rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, expected, strict=True)),
        "weight_diff": worst[0],
        "worst_weight": worst[1],
        "device": str(next(iter(weights.values())).device),
    }


# ---------------------------------------------------------------------------------------------------- sync
def run_sync(args) -> dict:
    import onnx
    import onnxruntime as ort

    _strict_fp32(False)
    spec = scale_spec("gpt2-small", 8, "eager")
    out = {}
    for clip in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            options = ort.SessionOptions()
            options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
            torch.manual_seed(0)
            trainer = ORTTrainer(
                spec.make().to(_DEVICE),
                spec.desc,
                optim.AdamConfig(lr=LR, alpha=BETAS[0], beta=BETAS[1], lambda_coef=WEIGHT_DECAY, epsilon=EPS),
                loss_fn=spec.loss_fn,
                options=_ort_options(False, clip=clip, session_options=options),
            )
            batches = [_on_gpu(b) for b in spec.batches(3)]
            trainer.train_step(*batches[0])  # the build, and its one-off transfers
            _sync()
            if _DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                for batch in batches[1:]:
                    trainer.train_step(*batch)
                waits = "none"
            except RuntimeError as error:
                waits = f"torch waited: {str(error).splitlines()[0]}"
                traceback.print_exc()
            finally:
                if _DEVICE == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            _sync()
            nodes = onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node
            memcpy = [n.op_type for n in nodes if n.op_type.startswith("Memcpy")]
            out[f"clip={clip}"] = {"torch_syncs_in_steps_2_3": waits, "memcpy_nodes": len(memcpy), "nodes": len(nodes)}
        print(json.dumps(out), flush=True)
    return out


# --------------------------------------------------------------------------------------------------- speed
def _build(name: str, args):
    tf32 = name.endswith("_tf32")
    _strict_fp32(tf32)
    base = name.removesuffix("_tf32").removesuffix("_pow2")
    spec = scale_spec(args.model, args.batch, "sdpa" if base.endswith("_sdpa") else "eager")
    torch.manual_seed(0)
    model = spec.make().to(_DEVICE)
    first = _on_gpu(spec.batches(1)[0])
    start = time.perf_counter()
    if base.startswith("pytorch"):
        step = torch_step(spec, model, copy_model=False)  # eager + fused AdamW, as benchmarks/scale.py
    else:
        trainer = ORTTrainer(
            model,
            spec.desc,
            optim.AdamConfig(lr=LR, alpha=BETAS[0], beta=BETAS[1], lambda_coef=WEIGHT_DECAY, epsilon=EPS),
            loss_fn=spec.loss_fn,
            options=_ort_options(tf32, arena="kNextPowerOfTwo" if name.endswith("_pow2") else None),
        )

        def step(batch):
            return trainer.train_step(*batch)

    step(first)
    _sync()
    return step, time.perf_counter() - start, spec


def run_speed(args) -> dict:
    names = args.contenders.split(",")
    steps, built = {}, {}
    for name in names:
        steps[name], built[name], spec = _build(name, args)
        print(f"built {name} in {built[name]:.1f} s", flush=True)
    batches = [_on_gpu(b) for b in spec.batches(3)]
    for name in names:
        _strict_fp32(name.endswith("_tf32"))
        for i in range(args.warmup):
            steps[name](batches[i % 3])
    _sync()
    wall = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            _strict_fp32(name.endswith("_tf32"))
            _sync()
            start, calls = time.perf_counter(), 0.0
            for i in range(args.steps):
                t = time.perf_counter()
                steps[name](batches[i % 3])
                calls += time.perf_counter() - t
            _sync()
            wall[name].append((time.perf_counter() - start) / args.steps * 1e3)
            host[name].append(calls / args.steps * 1e3)
    rows = {
        n: {
            "ms": statistics.median(wall[n]),
            "min": min(wall[n]),
            "host_ms": statistics.median(host[n]),
            "build_s": built[n],
        }
        for n in names
    }
    model = f"{SCALE_MODELS[args.model][-1]}, batch {args.batch} x 128"
    print(f"\n{model}; {args.rounds} rounds x {args.steps} steps, interleaved\n")
    print("| contender | ms/step median | min | host ms/call | build + 1st step s | x best eager (same precision) |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        tf32 = name.endswith("_tf32")
        eager = [rows[n]["ms"] for n in rows if n.startswith("pytorch") and n.endswith("_tf32") == tf32]
        ratio = f"{min(eager) / row['ms']:.2f}" if eager else "-"
        print(
            f"| {name} | {row['ms']:.2f} | {row['min']:.2f} | {row['host_ms']:.2f} | {row['build_s']:.1f} | {ratio} |",
            flush=True,
        )
    return rows


# -------------------------------------------------------------------------------------------------- memory
def child(args) -> None:
    if _DEVICE != "cuda":
        raise SystemExit("the memory section needs a GPU")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    free0, total = torch.cuda.mem_get_info()
    step, _, spec = _build(args.child, args)
    batches = [_on_gpu(b) for b in spec.batches(3)]
    for i in range(args.mem_steps):
        step(batches[i % 3])
    _sync()
    free1, _ = torch.cuda.mem_get_info()
    print(
        json.dumps({"held_mib": (free0 - free1) / 2**20, "torch_peak_mib": torch.cuda.max_memory_allocated() / 2**20})
    )


def run_memory(args) -> dict:
    out = {}
    for name in args.mem_contenders.split(","):
        command = [sys.executable, __file__, "--child", name, "--model", args.model, "--mem-steps", str(args.mem_steps)]
        if args.batch:
            command += ["--batch", str(args.batch)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        out[name] = json.loads(lines[-1]) if lines else {"error": done.stderr[-800:]}
        print(name, json.dumps(out[name]), flush=True)
    eager = min((r["held_mib"] for n, r in out.items() if n.startswith("pytorch") and "held_mib" in r), default=None)
    print("\n| contender | device memory held MiB | x best eager | torch peak allocated MiB |\n|---|---|---|---|")
    for name, row in out.items():
        if "held_mib" in row:
            ratio = f"{row['held_mib'] / eager:.2f}" if eager else "-"
            print(f"| {name} | {row['held_mib']:.0f} | {ratio} | {row['torch_peak_mib']:.0f} |")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(SCALE_MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--zoo-archs", default="", help="comma-separated: only these zoo architectures")
    parser.add_argument("--mem-contenders", default="pytorch,pytorch_sdpa,ort_autograd")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global _DEVICE
    _DEVICE = args.device
    if args.child:
        child(args)
        return 0
    if _DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark runs on a GPU (benchmarks/scale.py is the CPU one)")
    print(host_stamp() + "\n", flush=True)
    results = {}
    for section in args.sections.split(","):
        print(f"\n## {section}\n", flush=True)
        try:
            results[section] = {"sync": run_sync, "zoo": run_zoo, "speed": run_speed, "memory": run_memory}[section](
                args
            )
        except Exception as error:  # noqa: BLE001 - the next section still runs; the failure is in the output
            traceback.print_exc()
            results[section] = {"error": f"{type(error).__name__}: {error}"}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
