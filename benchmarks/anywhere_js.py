"""One training artifact, three runtimes: the train step's time in Python onnxruntime, onnxruntime-node and
onnxruntime-web (wasm, headless Chromium), 1 thread.

    python benchmarks/anywhere_js.py                                  # mlp, gpt2-tiny, gpt2 (5.2M), 12 steps each
    python benchmarks/anywhere_js.py --models gpt2 --steps 20
    python benchmarks/anywhere_js.py --models mlp --steps 4 --json /tmp/anywhere_js.json   # the smoke test's run

Each model is exported once by ``ort_trainer.export_training`` (AdamW lr 1e-3, weight decay 0.01, clipping off,
Dropout as the model has it: 0 in these) to a temporary folder, then the same plan, ``--steps`` batches of one
shape (the benchmarks' data: `_common` / `_hf`), runs in each runtime through its driver: ``ArtifactRunner`` (Python,
``intra_op_num_threads=1``), js/src/node.js in node (``intraOpNumThreads: 1``) and js/src/browser.js in Chromium
(``ort.env.wasm.numThreads = 1``), the page served on 127.0.0.1 by js/tools/run-browser.mjs. Every step feeds the
whole state and takes every updated tensor back, as a user's loop does.

Reported per runtime: the median wall ms of the steps after the first ``--warmup`` (the first run of a session
allocates), the median CPU ms of the process that computes (Python: ``time.process_time``; node:
``process.cpuUsage``; the browser: its renderer processes' utime + stime from /proc, 10 ms ticks), the ratios to
Python's medians, the peak RSS of node's process and of the browser's renderer (its wasm heap: capped at 4 GiB;
Python's is not shown: its process exported the model too), and the largest loss difference to Python over the
plan (node bit-equal, wasm within ~1e-5).
The host stamp (`_common.host_stamp`) heads the table: on a loaded machine read the CPU ratios, not the walls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import MODELS as COMMON_MODELS
from benchmarks._common import ModelSpec, host_stamp
from benchmarks._hf import GPT2, GPT2_DESC, _gpt2_batches, gpt2_spec, lm_loss
from benchmarks._js import run_js, write_plan
from ort_trainer import ArtifactRunner, export_training, optim

RUNTIMES = ("python", "node", "browser")
LR = 1e-3


def _gpt2_tiny() -> ModelSpec:
    return ModelSpec(
        "gpt2-tiny",
        "HF GPT-2 (2 layers, d 64, vocab 1000), batch 4 x 128, eager attention",
        lambda: GPT2(2, "eager", n_embd=64, n_head=2, vocab_size=1000),
        GPT2_DESC,
        lm_loss,
        _gpt2_batches(4, vocab=1000),
    )


def _mlp() -> ModelSpec:
    """`_common`'s MLP with its feature dim given as an int: an artifact keeps only dims the model leaves free."""
    spec = COMMON_MODELS["mlp"]
    desc = {**spec.desc, "inputs": [("x", ["batch", 784]), ("label", ["batch"])]}
    return dataclasses.replace(spec, desc=desc)


MODELS = {"mlp": _mlp, "gpt2-tiny": _gpt2_tiny, "gpt2": lambda: gpt2_spec(layers=4)}


def _export(spec: ModelSpec, folder: Path) -> tuple[Path, int]:
    torch.manual_seed(0)
    model = spec.make()
    parameters = sum(p.numel() for p in model.parameters())
    config = optim.AdamConfig(lr=LR, weight_decay=0.01)
    artifact = export_training(
        model, folder, inputs=spec.batches(1)[0], model_desc=spec.desc, optimizer=config, loss_fn=spec.loss_fn
    )
    return artifact, parameters


def _python(artifact: Path, batches: list[dict]) -> dict:
    runner = ArtifactRunner(artifact, threads=1)
    losses, wall, cpu = [], [], []
    for batch in batches:
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(runner.train_step(batch, LR))
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    import onnxruntime

    return {"losses": losses, "step_ms": wall, "step_cpu_ms": cpu, "runtime": f"onnxruntime {onnxruntime.__version__}"}


def measure(name: str, steps: int, warmup: int, runtimes: tuple[str, ...], work: Path) -> dict:
    """Export ``name``, run its plan in every runtime; the per-runtime medians and the raw step times."""
    spec = MODELS[name]()
    artifact, parameters = _export(spec, work / name / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    names = [e["name"] for e in manifest["inputs"]]
    batches = [{n: t.numpy() for n, t in zip(names, b, strict=True)} for b in spec.batches(steps)]
    plan = write_plan(work / name / "plan", batches, [LR] * steps, None)
    results = {}
    for runtime in runtimes:
        if runtime == "python":
            results[runtime] = _python(artifact, batches)
        else:
            results[runtime], _ = run_js(runtime, artifact, plan, work / name / runtime, threads=1)
    reference = np.array(results["python"]["losses"]) if "python" in results else None
    summary = {}
    for runtime, result in results.items():
        timed = slice(warmup, None)
        cpu = result.get("step_cpu_ms")
        summary[runtime] = {
            "runtime": result["runtime"],
            "wall_ms": statistics.median(result["step_ms"][timed]),
            "cpu_ms": statistics.median(cpu[timed]) if cpu else None,
            "max_loss_difference": None
            if reference is None
            else float(np.abs(np.array(result["losses"]) - reference).max()),
            "peak_rss_mib": result.get("peak_rss_mib"),
            "step_ms": result["step_ms"],
        }
    return {"model": name, "summary": spec.summary, "parameters": parameters, "steps": steps, "runtimes": summary}


def table(report: list[dict]) -> str:
    lines = [
        "| model | parameters | runtime | median ms / step (wall) | median CPU ms | x Python (wall) "
        "| x Python (CPU) | peak RSS MiB | max loss diff |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in report:
        python = entry["runtimes"].get("python", {})
        for r in entry["runtimes"].values():
            ratio = f"{r['wall_ms'] / python['wall_ms']:.2f}" if python else "-"
            cpu = f"{r['cpu_ms']:.1f}" if r["cpu_ms"] is not None else "-"
            cpu_ratio = f"{r['cpu_ms'] / python['cpu_ms']:.2f}" if python and r["cpu_ms"] else "-"
            diff = f"{r['max_loss_difference']:.1e}" if r["max_loss_difference"] is not None else "-"
            rss = f"{r['peak_rss_mib']:.0f}" if r["peak_rss_mib"] else "-"
            lines.append(
                f"| {entry['model']} | {entry['parameters'] / 1e6:.2f}M | {r['runtime']} | {r['wall_ms']:.1f} | "
                f"{cpu} | {ratio} | {cpu_ratio} | {rss} | {diff} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt2-tiny,gpt2", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--steps", type=int, default=12, help="train steps per runtime (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated, of {RUNTIMES}")
    parser.add_argument("--json", type=Path, help="also write the report (with every step's time) here")
    args = parser.parse_args()
    models = args.models.split(",")
    runtimes = tuple(args.runtimes.split(","))
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(runtimes) - set(RUNTIMES))
    if unknown:
        parser.error(f"unknown models or runtimes: {unknown}")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    print(host_stamp() + "\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="anywhere_js_") as work:
        report = [measure(m, args.steps, args.warmup, runtimes, Path(work)) for m in models]
    print(table(report))
    for entry in report:
        print(f"{entry['model']}: {entry['summary']}")
    if args.json:
        args.json.write_text(json.dumps({"host": host_stamp(), "report": report}, indent=1))


if __name__ == "__main__":
    main()
