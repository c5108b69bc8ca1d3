"""Where ORTTrainer's peak RSS goes on variable-length batches, phase by phase, against eager PyTorch.

    python benchmarks/varlen_memory.py --model gpt2-small
    python benchmarks/varlen_memory.py --model gpt2-124m --steps 6
    python benchmarks/varlen_memory.py --model gpt2-tiny --steps 3 --variants pytorch_sdpa,cold,hit   # smoke run

`benchmarks/varlen.py` reports one peak RSS per contender; this script splits ORTTrainer's into the phases of its
build and first steps, so that the gap to PyTorch has names. The batches are varlen.py's (a collator's, the
longest first). Each variant runs alone in a child process (RSS is per process):

* ``pytorch`` / ``pytorch_sdpa``: eager PyTorch (eager / sdpa attention, fused AdamW), the reference;
* ``cold``: ORTTrainer with its defaults and an empty graph cache (trace, export, session, first run);
* ``cold_in_process``: ``cold`` with every export in this process (``ORT_TRAINER_EXPORT_IN_CHILD=0``; by default
  graphs of 16 MiB of inputs and more export in a forked child, whose memory goes back to the OS);
* ``hit``: the same, its graph found in the cache that ``cold`` filled (no export: what a resumed job pays);
* ``no_arena``: ``hit`` with ONNX Runtime's CPU arena off (``enable_cpu_mem_arena = False``, no shared arena):
  memory goes back to the OS after every run, at a cost in speed (page faults);
* ``same_as_requested``: ``hit`` with the shared arena extended by what is asked (``arena_extend_strategy`` 1)
  instead of ONNX Runtime's default doubling.

Per variant: the resident size (VmRSS) after each phase (``setup``: torch, transformers, the model and the batches;
``store``: the trainer built, its flat buffers and optimizer state allocated; ``traced`` and ``exported``, where
they ran in the trainer's process (not when its graphs are built in a child: `ORT_TRAINER_EXPORT_IN_CHILD`);
``graph``: the first graph in hand; ``session``; ``first step``; ``steps``: after --steps batches), the peak (VmHWM)
and its ratio to the better eager peak, the memory of each export child of its own (pages it does not share with the
trainer's process, at the end of its export: what it adds to the machine's use while it runs; "–" where the exports
ran in the process), and the median CPU ms of the steps after the first (at 1 thread).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks import varlen
from benchmarks._common import host_stamp, set_torch_threads, status_kb

VARIANTS = ("pytorch", "pytorch_sdpa", "cold", "cold_in_process", "hit", "no_arena", "same_as_requested")
PHASES = ("setup", "store", "traced", "exported", "graph", "session", "first step", "steps")


def _mib(key: str) -> int:
    return status_kb(key) // 1024


class _Phases:
    """VmRSS at named points of the build, recorded by wrapping the engine's phase functions (first call only)."""

    def __init__(self):
        self.rss: dict[str, int] = {}

    def mark(self, phase: str) -> None:
        self.rss.setdefault(phase, _mib("VmRSS"))

    def after(self, module, name: str, phase: str) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            if phase == "graph":
                self.mark("store")  # the trainer is built when its first step asks for its graphs
            result = original(*args, **kwargs)
            self.mark(phase)
            return result

        setattr(module, name, wrapped)

    def install(self) -> None:
        from ort_trainer.engine.autograd import _build as _autograd_build

        self.after(_autograd_build._GraphBuilder, "graphs", "graph")
        self.after(_autograd_build, "trace_graph", "traced")
        self.after(_autograd_build, "exported_graph", "exported")
        self.after(_autograd_build, "AutogradSession", "session")


class _ExportChildren(logging.Handler):
    """MiB of its own (pages not shared with the trainer's process) of each export child, from its debug record."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.sizes: list[int] = []
        logger = logging.getLogger("ort_trainer")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"exported in a child \(pid \d+\): (\d+) MiB of its own", record.getMessage())
        if found:
            self.sizes.append(int(found.group(1)))


def _arena(variant: str) -> None:
    """Set ONNX Runtime's CPU memory up as ``variant`` says (before the trainer makes its session options)."""
    import onnxruntime as ort

    from ort_trainer.engine import _build
    from ort_trainer.runtime import _shared_arena

    if variant == "no_arena":
        _shared_arena._registered = lambda: False
        made = _build.session_options_for

        def without_arena(*args, **kwargs):
            options = made(*args, **kwargs)
            options.enable_cpu_mem_arena = False
            return options

        _build.session_options_for = without_arena
    elif variant == "same_as_requested":

        def registered() -> bool:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))  # kSameAsRequested
            return True

        _shared_arena._registered = registered


def child(args) -> None:
    """One variant in this process: print its phases, peak and step times as JSON."""
    set_torch_threads(args.threads)
    spec, batch, vocab = varlen.model_spec(args.model, args.batch)
    batches = varlen.make_batches(varlen.spec_family(args.model), args.steps, batch, vocab)
    phases = _Phases()
    phases.mark("setup")
    name = args.child if args.child.startswith("pytorch") else "ort_trainer"
    if name == "ort_trainer":
        phases.install()
        _arena(args.child)
    builds = varlen.Builds()
    builds.install()
    children = _ExportChildren()
    step, keep, _, _ = varlen.build(name, args, batches[0], builds)
    phases.mark("first step")
    cpu = []
    for later in batches[1:]:
        start = time.process_time()
        step(later)
        cpu.append((time.process_time() - start) * 1000)
    phases.mark("steps")
    result = {"phases": phases.rss, "peak": _mib("VmHWM"), "cpu_ms": statistics.median(cpu) if cpu else None}
    result["export_children"] = children.sizes
    print("RESULT " + json.dumps(result), flush=True)
    del keep


def run(args) -> dict:
    """Every variant in a child of its own, in order (``hit`` and the arena variants read what ``cold`` stored)."""
    cache = tempfile.mkdtemp(prefix="varlen_memory_cache_")
    results = {}
    try:
        for variant in args.variants.split(","):
            env = {**os.environ, "ORT_TRAINER_GRAPH_CACHE_DIR": cache}
            if variant == "cold_in_process":  # an empty cache of its own, every export in the process
                env.update(ORT_TRAINER_GRAPH_CACHE_DIR=tempfile.mkdtemp(dir=cache), ORT_TRAINER_EXPORT_IN_CHILD="0")
            command = [sys.executable, __file__, "--child", variant, "--model", args.model, "--steps", str(args.steps)]
            command += ["--threads", str(args.threads)] + (["--batch", str(args.batch)] if args.batch else [])
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"variant {variant} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            results[variant] = json.loads(lines[-1][len("RESULT ") :])
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return results


def print_table(results: dict) -> None:
    eager = [results[n]["peak"] for n in ("pytorch", "pytorch_sdpa") if n in results]
    best = min(eager) if eager else None
    print(f"| variant | {' | '.join(PHASES)} | peak RSS MiB | peak × best eager | export children MiB | CPU ms/step |")
    print("|---" * (len(PHASES) + 5) + "|")
    for name, row in results.items():
        cells = [str(row["phases"].get(p, "–")) for p in PHASES]
        ratio = f"{row['peak'] / best:.2f}" if best else "–"
        cpu = f"{row['cpu_ms']:.0f}" if row["cpu_ms"] is not None else "–"
        exporter = " + ".join(str(size) for size in row.get("export_children") or []) or "–"
        print(f"| {name} | {' | '.join(cells)} | {row['peak']} | {ratio} | {exporter} | {cpu} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small", choices=sorted(varlen.MODELS))
    parser.add_argument("--batch", type=int, default=None, help="rows per batch (default: the model's)")
    parser.add_argument("--steps", type=int, default=12, help="batches each variant runs (the longest first)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {VARIANTS}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads = ORT intra-op threads")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    for name in args.variants.split(","):
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {VARIANTS}")
    if args.steps < 2:
        parser.error("--steps: at least 2 (the build step and a later one)")
    stamp = host_stamp()
    results = run(args)
    print(stamp + "\n")
    print(f"model: {args.model}; {args.steps} batches from varlen.py's collator, the longest first\n")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"host": stamp, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
