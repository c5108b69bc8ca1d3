"""Peak / steady RSS and first-step (build) time of HF GPT-2 training: PyTorch eager vs ORTTrainer.

Each contender runs alone in a fresh subprocess (RSS is per process): it builds the model from a
``GPT2Config`` (nothing is downloaded), trains ``--steps`` steps with AdamW (lr 1e-3, eps 1e-6, no
weight decay, no clipping, dropout 0) on random tokens and reports

* ``first step``: the first ``train_step`` (ORTTrainer: export + graph passes + gradient graph +
  sessions + one step; PyTorch: one step with optimizer-state creation),
* ``step``: the median of the later steps,
* ``peak``: the process's peak resident size over its whole life (``VmHWM``),
* ``steady``: the resident size after the last step (``VmRSS``).

The per-phase build times come from the ``ort_trainer`` logger at INFO (printed by ``--phases``).
``--fit`` fits ``RSS = a + b * parameters`` over the measured sizes for each contender and
extrapolates the largest GPT-2 of the standard family that stays under ``--budget-gib``.

``--limit-gib N`` runs every child in a memory cgroup of N GiB (`benchmarks/_cgroup.py`, needs root): a
size that does not fit is killed by the kernel and reported as such, which confirms a fit by running it.

    python benchmarks/memory.py --sizes 124M,350M --threads 1
    python benchmarks/memory.py --sizes 30x1280,31x1280 --limit-gib 12 --threads 2 --steps 2
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
# name -> (n_layer, n_embd, n_head) of the GPT-2 family (vocab 50257, 1024 positions)
SIZES = {
    "124M": (12, 768, 12),
    "350M": (24, 1024, 16),
    "774M": (36, 1280, 20),
    "1.5B": (48, 1600, 25),
    "2.7B": (32, 2560, 32),
    "6.7B": (32, 4096, 32),
}
VOCAB, POSITIONS = 50257, 1024
DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("label", ["batch", "seq"])],
    "outputs": [("loss", [], True)],
}


def parameters(n_layer: int, n_embd: int) -> int:
    """Parameters of a GPT-2 LM with a tied head (embeddings, blocks, final norm)."""
    block = 12 * n_embd * n_embd + 13 * n_embd
    return VOCAB * n_embd + POSITIONS * n_embd + n_layer * block + 2 * n_embd


def host_stamp() -> str:
    """`benchmarks._common.host_stamp`, imported here only: a child imports nothing it does not measure."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks._common import host_stamp as common_stamp  # noqa: PLC0415 - parent process only

    return common_stamp()


# ------------------------------------------------------------------------------------------ child
def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


class _PhaseLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{_status_kib('VmRSS') / 1024:.0f} MiB | {record.getMessage()}")


def _model(layers: int, width: int, heads: int, attn: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB, n_positions=POSITIONS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
    )  # fmt: skip

    class GPT2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(config)

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    torch.manual_seed(0)
    return GPT2()


def _loss(logits, label):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    layers, width, heads = _shape(args.size)
    model = _model(layers, width, heads, args.attn)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask = torch.ones_like(x)
    phases = _PhaseLog()
    if args.contender == "pytorch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0, fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = _loss(model(x, mask), y)
            loss.backward()
            opt.step()
            return loss
    else:
        from ort_trainer import ORTTrainer, optim

        logging.getLogger("ort_trainer").addHandler(phases)
        logging.getLogger("ort_trainer").setLevel(logging.INFO)
        options = {"utils": {"grad_norm_clip": False}}
        if args.share != "default":
            options["utils"]["share_module_parameters"] = args.share == "on"
        if args.arena == "shrink":
            options["utils"]["shrink_memory_arena"] = True
        if args.arena == "off":
            import onnxruntime as ort

            session_options = ort.SessionOptions()
            session_options.log_severity_level = 3
            session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session_options.enable_cpu_mem_arena = False
            options["session_options"] = session_options
        trainer = ORTTrainer(model, DESC, optim.AdamConfig(lr=1e-3, epsilon=1e-6), loss_fn=_loss, options=options)
        if not args.keep_module:
            del model  # the user's module is theirs to keep or drop; "--keep-module" keeps it, as most scripts do
        gc.collect()

        def step():
            return trainer.train_step(x, mask, y)

    constructed = _status_kib("VmRSS")
    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    times = []
    for _ in range(args.steps - 1):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    gc.collect()
    return {
        "contender": args.contender,
        "size": args.size,
        "parameters": parameters(layers, width),
        "constructed_gib": constructed / 1024**2,
        "peak_gib": _status_kib("VmHWM") / 1024**2,
        "steady_gib": _status_kib("VmRSS") / 1024**2,
        "first_step_s": first,
        "step_s": statistics.median(times) if times else float("nan"),
        "phases": phases.lines,
    }


def _shape(size: str) -> tuple[int, int, int]:
    if size in SIZES:
        return SIZES[size]
    layers, width = (int(v) for v in size.lower().split("x"))
    return layers, width, max(1, width // 64)


# ------------------------------------------------------------------------------------------ parent
def run(args, contender: str, size: str) -> dict:
    command = [sys.executable, __file__, "--child", contender, "--sizes", size, "--steps", str(args.steps)]
    command += ["--threads", str(args.threads), "--batch", str(args.batch), "--seq", str(args.seq)]
    command += ["--attn", args.attn, "--share", args.share]
    command += ["--keep-module"] if args.keep_module else []
    command += ["--arena", args.arena]
    from benchmarks._cgroup import memory_limit  # noqa: PLC0415 - host_stamp put benchmarks/ on the path

    with memory_limit(args.limit_gib) as enter:
        out = subprocess.run(command, capture_output=True, text=True, check=False, preexec_fn=enter)
    if args.limit_gib and out.returncode in (-9, 137):  # the cgroup's OOM killer: this size does not fit
        layers, width, _ = _shape(size)
        return {"contender": contender, "size": size, "parameters": parameters(layers, width), "oom": True}
    if out.returncode != 0:
        raise RuntimeError(f"{contender} {size} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit(results: list[dict], budget_gib: float) -> str:
    """Per contender: RSS = a + b * params (least squares), the largest standard GPT-2 under the budget,
    and the most layers at the widths of GPT-2 large (1280) and XL (1600). Extrapolated, not measured."""
    lines = []
    for contender in sorted({r["contender"] for r in results}):
        rows = [r for r in results if r["contender"] == contender]
        if len({r["parameters"] for r in rows}) < 2:
            continue
        for key in ("peak_gib", "steady_gib"):
            slope, intercept = _line([r["parameters"] for r in rows], [r[key] for r in rows])
            fits = [n for n, (lay, wid, _) in SIZES.items() if intercept + slope * parameters(lay, wid) <= budget_gib]
            fits = fits if slope > 0 else ["n/a (no growth measured)"]
            deepest = {w: _most_layers(w, intercept, slope, budget_gib) for w in (1280, 1600)}
            lines.append(
                f"{contender} {key[:-4]}: {intercept:.2f} GiB + {slope * 1e9:.2f} GiB per 1e9 parameters "
                f"({slope * GIB:.1f} bytes/parameter) -> {budget_gib:g} GiB holds up to GPT-2 "
                f"{fits[-1] if fits else 'none'}; {deepest[1280]}x1280, {deepest[1600]}x1600 (extrapolated)"
            )
    return "\n".join(lines)


def _most_layers(width: int, intercept: float, slope: float, budget_gib: float) -> int | str:
    if slope <= 0:
        return "n/a (no growth measured)"
    layers = 0
    while intercept + slope * parameters(layers + 1, width) <= budget_gib:
        layers += 1
    return layers


def _line(xs, ys):
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="124M", help="comma list of 124M/350M/774M/1.5B or LAYERSxWIDTH")
    parser.add_argument("--contenders", default="pytorch,ort_trainer")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--attn", default="eager", help="GPT-2 attn_implementation (eager or sdpa)")
    parser.add_argument(
        "--share", default="default", choices=("default", "on", "off"), help="ORTTrainer: utils.share_module_parameters"
    )
    parser.add_argument(
        "--arena", default="default", help="ORTTrainer: 'shrink' (utils.shrink_memory_arena) or 'off' (no CPU arena)"
    )
    parser.add_argument("--keep-module", action="store_true", help="ORTTrainer: the script keeps its module")
    parser.add_argument("--phases", action="store_true", help="print ORTTrainer's logged build phases")
    parser.add_argument("--fit", action="store_true", help="fit RSS vs parameters, extrapolate to --budget-gib")
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument(
        "--limit-gib",
        type=float,
        help="run each child in a memory cgroup of this size: a run that does not fit is reported, not fatal",
    )
    parser.add_argument("--json", help="also write the results (list of dicts) to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        args.contender, args.size = args.child, args.sizes
        print(json.dumps(child(args)))
        return 0
    print(host_stamp() + "\n")
    print(f"batch {args.batch}x{args.seq}, {args.steps} steps, {args.threads} thread(s), attention {args.attn}\n")
    print("| GPT-2 | params | contender | peak RSS GiB | steady RSS GiB | first step s | step s |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for size in args.sizes.split(","):
        for contender in args.contenders.split(","):
            r = run(args, contender, size)
            results.append(r)
            if r.get("oom"):
                print(f"| {size} | {r['parameters'] / 1e6:.0f}M | {contender} | > {args.limit_gib:g} (killed) | | | |")
                continue
            print(
                f"| {size} | {r['parameters'] / 1e6:.0f}M | {contender} | {r['peak_gib']:.2f} | {r['steady_gib']:.2f} "
                f"| {r['first_step_s']:.1f} | {r['step_s']:.2f} |",
                flush=True,
            )
            if args.phases and r["phases"]:
                print("\n".join("    " + line for line in r["phases"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.fit:
        print("\n" + fit([r for r in results if not r.get("oom")], args.budget_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
