"""A training artifact's step (docs/anywhere.md) against ORTTrainer.train_step, on the same model and batch.

    python benchmarks/anywhere.py                       # mlp and lm, 1 thread
    python benchmarks/anywhere.py --models lm --rounds 9 --keep /tmp/anywhere

Contenders, interleaved in one process (medians over --rounds rounds of --steps steps each), same initial weights,
same AdamW (lr 1e-3, eps 1e-6, no clipping: `benchmarks._common`), 1 thread unless told otherwise:
  ORTTrainer.train_step   the autograd engine: ORT runs forward + backward, torch's fused AdamW updates in place
  artifact (onnxruntime)  the exported train_step.onnx in a plain InferenceSession (`ArtifactRunner`): forward,
                          backward and the update in one graph, the state fed and fetched as numpy arrays each step

Hook for other runtimes (the JS driver's node and browser timings): ``--keep DIR`` leaves, per model, the artifact
folder ``DIR/<model>/artifact`` and the timed batch as ``DIR/<model>/batch.safetensors`` (the manifest's input
names), and ``--json FILE`` writes the table's numbers; ``CONTENDERS`` maps a name to a function that returns a step
callable, for contenders run from Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import BETAS, EPS, LR, MODELS, WEIGHT_DECAY, ModelSpec, ort_trainer_step, print_host_stamp
from benchmarks._common import session_options as ort_session_options
from ort_trainer import ArtifactRunner, export_training, optim

Step = Callable[[], object]


def _config() -> optim.AdamConfig:
    return optim.AdamConfig(lr=LR, alpha=BETAS[0], beta=BETAS[1], lambda_coef=WEIGHT_DECAY, epsilon=EPS)


def export(spec: ModelSpec, model: torch.nn.Module, batch: tuple, folder: Path) -> Path:
    """The artifact of ``model`` with the benchmark's AdamW and no clipping (as the ORTTrainer contender)."""
    return export_training(
        model, folder, inputs=batch, model_desc=spec.desc, optimizer=_config(), loss_fn=spec.loss_fn,
        options={"utils": {"grad_norm_clip": False}}, overwrite=True,
    )  # fmt: skip


def trainer_contender(spec: ModelSpec, model: torch.nn.Module, folder: Path, batch: tuple, threads: int) -> Step:
    step, _ = ort_trainer_step(spec, model, ort_session_options(threads), True, batch)
    return lambda: step(batch)


def artifact_contender(spec: ModelSpec, model: torch.nn.Module, folder: Path, batch: tuple, threads: int) -> Step:
    runner = ArtifactRunner(folder, threads=threads)
    feeds = {name: t.numpy() for name, t in zip(runner.input_names, batch, strict=True)}
    runner.train_step(feeds, LR)
    return lambda: runner.train_step(feeds, LR)


CONTENDERS: dict[str, Callable[..., Step]] = {
    "ORTTrainer.train_step": trainer_contender,
    "artifact (onnxruntime)": artifact_contender,
}


def measure(spec: ModelSpec, args, keep: Path) -> dict[str, float]:
    torch.manual_seed(0)
    model = spec.make()
    batch = spec.batches(1)[0]
    folder = export(spec, model, batch, keep / spec.name / "artifact")
    _save_batch(folder, batch, keep / spec.name / "batch.safetensors")
    steps = {name: make(spec, model, folder, batch, args.threads) for name, make in CONTENDERS.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in steps if r % 2 == 0 else list(reversed(steps)):
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _save_batch(folder: Path, batch: tuple, target: Path) -> None:
    import safetensors.numpy

    names = [e["name"] for e in json.loads((folder / "manifest.json").read_text())["inputs"]]
    safetensors.numpy.save_file({n: t.numpy() for n, t in zip(names, batch, strict=True)}, str(target))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,lm", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads and ORT intra-op threads")
    parser.add_argument("--keep", type=Path, default=None, help="keep the artifacts and batches here (for JS runs)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_host_stamp()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        keep = args.keep or Path(scratch)
        for name in args.models.split(","):
            spec = MODELS[name]
            results[name] = measure(spec, args, keep)
            base = results[name]["ORTTrainer.train_step"]
            print(
                f"{spec.name}: {spec.summary}; {args.threads} thread(s), median ms per step over {args.rounds} rounds"
            )
            for contender, ms in results[name].items():
                print(f"  {contender:<26} {ms:9.2f} ms  {ms / base:5.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
