"""What an eval step leaves resident in a training run: ORTTrainer's autograd engine, train / eval / train.

One process per arena setting (RSS is per process). Each builds the trainer (graph cache shared by the
children, so only the first pays the trace and export), runs two train steps, an eval step and another
train step, and reports the resident size after each phase and the steps' CPU times:

* ``shared``: the session options the trainer makes (its training and eval sessions take CPU memory from
  one arena in ONNX Runtime's environment, `ort_trainer.runtime._shared_arena`);
* ``separate``: the same options without that entry, so each session keeps an arena of its own.

    python benchmarks/eval_memory.py --model gpt2-124m --threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnxruntime as ort
import torch

from benchmarks._common import host_stamp, ort_trainer_step
from benchmarks._hf import SCALE_MODELS, scale_spec

ARENAS = ("separate", "shared")


def _options(arena: str, threads: int) -> ort.SessionOptions:
    """The trainer's own CPU session options (`engine._build.session_options_for`), with or without the
    environment's arena."""
    from ort_trainer.config import ORTTrainerOptions
    from ort_trainer.engine._build import session_options_for

    if arena == "shared":
        options = session_options_for(ORTTrainerOptions({}))
    else:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_mem_pattern = False
    options.intra_op_num_threads = threads
    return options


def _rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("VmRSS not in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    spec = scale_spec(args.model)
    torch.manual_seed(0)
    model = spec.make()
    batches = spec.batches(3)
    options = _options(args.child, args.threads)
    step, trainer = ort_trainer_step(spec, model, options, True, batches[0], {"engine": "autograd"}, False)
    del model
    gc.collect()
    result: dict = {}

    def timed(name: str, run) -> None:
        start = time.process_time()
        run()
        result[name + "_cpu_s"] = time.process_time() - start
        result[name + "_rss"] = _rss_mib()

    timed("train", lambda: step(batches[1]))
    timed("eval", lambda: trainer.eval_step(*batches[2]))
    timed("eval_again", lambda: trainer.eval_step(*batches[2]))
    timed("train_after_eval", lambda: step(batches[2]))
    print("RESULT " + json.dumps(result), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(SCALE_MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="children per arena setting, interleaved")
    parser.add_argument("--child", choices=ARENAS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    os.environ.setdefault("ORT_TRAINER_GRAPH_CACHE_DIR", tempfile.mkdtemp(prefix="eval_memory_graphs_"))
    print(host_stamp())
    print(f"model {args.model}, {args.threads} thread(s), {args.rounds} rounds, one process per run\n")
    header = "| arena | RSS after train MiB | after eval | after train again | eval CPU s (1st / 2nd) | train CPU s |"
    print(header)
    print("|---|---|---|---|---|---|")
    for _ in range(args.rounds):
        for arena in ARENAS:
            command = [sys.executable, __file__, "--child", arena, "--model", args.model]
            done = subprocess.run([*command, "--threads", str(args.threads)], capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"| {arena} | child failed (exit {done.returncode}): {done.stderr.strip()[-300:]} |", flush=True)
                continue
            r = json.loads(lines[-1].removeprefix("RESULT "))
            print(
                f"| {arena} | {r['train_rss']} | {r['eval_rss']} | {r['train_after_eval_rss']} | "
                f"{r['eval_cpu_s']:.2f} / {r['eval_again_cpu_s']:.2f} | {r['train_after_eval_cpu_s']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
