"""Variable-length fine-tunes: ORTTrainer, ORTModule and torch.compile vs PyTorch on the batches a collator makes.

    python benchmarks/varlen.py --model gpt2-small --steps 40                     # all contenders, ~10 min
    python benchmarks/varlen.py --model bert-small --steps 40
    python benchmarks/varlen.py --model gpt2-124m --steps 16 --contenders pytorch,pytorch_sdpa,ort_trainer,ortmodule
    python benchmarks/varlen.py --model gpt2-tiny --steps 5 --contenders pytorch,ort_trainer,ortmodule_marked \\
        --sections speed --json /tmp/varlen.json                                  # the smoke test's run
    python benchmarks/varlen.py --from-json /tmp/varlen.json                      # its tables again

Data, the same batches for every contender: ``--steps x --batch`` examples (a quarter batch fewer: the epoch ends
in a smaller batch) whose token counts are drawn (seed 0) from 13 lengths, 32, 40, ..., 128 (shorter ones a
little more likely), random token ids (1..vocab-1; the pad id is 0), grouped by length with transformers'
``LengthGroupedSampler`` (what ``group_by_length`` uses: shuffled, cut into about 4 mega-batches each sorted by
decreasing length, the longest example in the first batch) and padded per batch by transformers' own collators
over a real ``PreTrainedTokenizerFast`` (a word-level vocabulary built in memory; nothing is downloaded): GPT-2
(causal LM): ``DataCollatorForLanguageModeling(mlm=False)``, labels -100 on the padding, the loss shifted by one
token as ``GPT2LMHeadModel`` shifts it; BERT (sequence classification, 2 labels): ``DataCollatorWithPadding``.
Every batch is (input_ids, attention_mask, labels).

Models (`benchmarks/_hf.py`, dropout 0): gpt2-small (4 layers d 256 vocab 8000, batch 8), bert-small (4 layers
d 256, batch 16), gpt2-124m (GPT2Config defaults, batch 4), gpt2-tiny (2 layers d 64 vocab 1000, batch 4: the
smoke test). AdamW lr 1e-3, betas 0.9/0.999, eps 1e-6, no weight decay, no clipping (`_common`), the same
initial weights for every contender.

Contenders: pytorch / pytorch_sdpa (eager, ``attn_implementation`` eager / sdpa, fused AdamW),
compile_dynamic (``torch.compile(model, dynamic=True)``, inductor, eager attention), ort_trainer (ORTTrainer, its
default engine, ``model_desc`` naming the dims "batch" and "seq"), ortmodule (``ORTModule(model)`` in the eager
loop with torch's fused AdamW), ortmodule_marked (the same, every input dim marked with
``torch._dynamo.mark_dynamic`` before the call: Dynamo's first graph is the symbolic one) and compile_ort
(``torch.compile(model, backend="ort_trainer")``, the same loop).
Every ort contender starts from an empty graph cache of its own (a temporary folder): its builds are cold.

What is measured (--sections, default both):
* speed: every contender built in this one process (its first step, on the longest batch, is the build), then
  steps 2..N interleaved: each step runs every contender on the same batch, the order reversed every other step.
  Per contender: graphs built (ORTTrainer: training / eval sessions, counted where the engine opens one;
  ORTModule / compile_ort: ONNX Runtime graphs per kind (forward, backward), counted where each is built; Dynamo
  graphs for every torch.compile: ``torch._dynamo`` counters), the first step's seconds, the median wall and
  process-CPU ms of the later steps (CPU time is the compute itself at 1 thread, robust on a loaded machine),
  the slowest later step (CPU ms) over that median, the worst later step over the median with each step's CPU
  time taken over the best eager's on the same batch (a batch's length cancels out: a rebuild stands out; the
  spike goal reads this one), the loss of every step. "x best eager" = the faster median of pytorch /
  pytorch_sdpa over the contender's (> 1: faster than PyTorch).
* memory: each contender alone in a child process (this script with --child), cold cache, its first
  --mem-steps batches (the first is the longest): peak RSS (VmHWM, the build included) and its ratio to the
  best eager's.
Goals (checked in the table's last column): steady >= 1.0x best eager; one graph per mode (a training graph; a
forward and a backward graph); no later step over 2x the median; peak RSS <= 1.1x PyTorch's. A build after the
first step is listed with its step, the batch's shape, and what the library logged or warned. Default 1 thread
(``torch.set_num_threads`` = ORT intra-op threads). Every table is stamped with the host (`_common.host_stamp`,
the command included): read ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections import defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BETAS,
    EPS,
    LR,
    WEIGHT_DECAY,
    ModelSpec,
    host_stamp,
    set_torch_threads,
    status_kb,
    torch_step,
    wrapped_step,
)
from benchmarks._hf import BERT_DESC, GPT2, GPT2_DESC, SCALE_MODELS, BertClassifier

CONTENDERS = (
    "pytorch", "pytorch_sdpa", "compile_dynamic", "ort_trainer", "ortmodule", "ortmodule_marked", "compile_ort",
)  # fmt: skip
DEFAULT_CONTENDERS = "pytorch,pytorch_sdpa,compile_dynamic,ort_trainer,ortmodule"
EAGER = ("pytorch", "pytorch_sdpa")
DYNAMO = ("compile_dynamic", "ortmodule", "ortmodule_marked", "compile_ort")
SECTIONS = ("speed", "memory")
LENGTHS = tuple(range(32, 129, 8))  # 13 token counts an example may have
PAD_ID = 0
_CACHE_ENV = "ORT_TRAINER_GRAPH_CACHE_DIR"

# name -> (family, layers, config, batch, summary); the HF configs of `_hf.SCALE_MODELS`, GPT-2 124M at batch 4
# (its last batch, 3 rows, is no size-1 batch, which every tracer specialises), and a tiny GPT-2 for the smoke test
MODELS = {
    "gpt2-small": (*SCALE_MODELS["gpt2-small"][:3], 8, SCALE_MODELS["gpt2-small"][4]),
    "bert-small": (*SCALE_MODELS["bert-small"][:3], 16, SCALE_MODELS["bert-small"][4]),
    "gpt2-124m": (*SCALE_MODELS["gpt2-124m"][:3], 4, SCALE_MODELS["gpt2-124m"][4]),
    "gpt2-tiny": ("gpt2", 2, {"n_embd": 64, "n_head": 2, "vocab_size": 1000}, 4, "HF GPT-2 2 layers d 64 vocab 1000"),
}


# ------------------------------------------------------------------------------------------ data
def shifted_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``GPT2LMHeadModel``'s loss: position t predicts token t + 1; -100 labels (the padding) are ignored."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _tokenizer(vocab: int):
    """A real fast tokenizer (word-level, vocabulary in memory): what the collators pad with. Pad id 0, right."""
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel

    words = {"[PAD]": PAD_ID, "[UNK]": 1, **{f"t{i}": i for i in range(2, vocab)}}
    model = tokenizers.Tokenizer(WordLevel(words, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="[PAD]", unk_token="[UNK]")


def make_batches(family: str, steps: int, batch: int, vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` batches (the last smaller) of examples of random lengths, grouped by length and padded by
    transformers' collators: (input_ids, attention_mask, labels)."""
    import transformers
    from transformers.trainer_pt_utils import LengthGroupedSampler

    g = torch.Generator().manual_seed(seed)
    count = steps * batch - batch // 4  # the epoch's last batch is a quarter smaller
    weights = torch.linspace(2.0, 1.0, len(LENGTHS))  # shorter examples a little more likely
    lengths = [LENGTHS[i] for i in torch.multinomial(weights, count, replacement=True, generator=g).tolist()]
    examples = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        example = {"input_ids": ids}
        if family == "bert":
            example["label"] = int(torch.randint(0, 2, (), generator=g))
        examples.append(example)
    tokenizer = _tokenizer(vocab)
    if family == "gpt2":
        collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels -100 on the padding
    else:
        collate = transformers.DataCollatorWithPadding(tokenizer)
    order = list(LengthGroupedSampler(batch, lengths=lengths, generator=torch.Generator().manual_seed(seed)))
    out = []
    for start in range(0, count, batch):
        padded = collate([examples[i] for i in order[start : start + batch]])
        out.append((padded["input_ids"], padded["attention_mask"], padded["labels"]))
    return out


def model_spec(name: str, batch: int | None, attn: str = "eager") -> tuple[ModelSpec, int, int]:
    """(the model's `ModelSpec` (its ``batches`` unused), its batch, its vocabulary)."""
    family, layers, config, default_batch, summary = MODELS[name]
    vocab = config.get("vocab_size", 8000)
    if family == "gpt2":
        make, desc, loss = (lambda: GPT2(layers, attn, **config)), GPT2_DESC, shifted_lm_loss
    else:
        make, desc = (lambda: BertClassifier(layers, attn, **config)), BERT_DESC
        loss = torch.nn.functional.cross_entropy
    batch = batch or default_batch
    spec = ModelSpec(name, f"{summary}, batch {batch}, {attn} attention", make, desc, loss, lambda n: [])
    return spec, batch, vocab


# ------------------------------------------------------------------------------------------ build counting
class Builds:
    """Every graph built, attributed to the contender and step running at the moment: ORTTrainer's sessions
    (`_autograd_session._ShapeSession`, one per training / eval graph), ORTModule's and the compile backend's
    ONNX Runtime graphs (`module._graph.OrtGraph`, by kind), and what ``ort_trainer`` logged or warned."""

    def __init__(self):
        self.contender: str | None = None
        self.step = -1
        self.shape: list[int] = []
        self.events: list[dict] = []  # {contender, step, shape, kind}
        self.messages: list[dict] = []  # {contender, step, shape, level, message}

    @contextlib.contextmanager
    def running(self, contender: str, step: int, batch: tuple):
        self.contender, self.step, self.shape = contender, step, list(batch[0].shape)
        try:
            yield
        finally:
            self.contender = None

    def _add(self, kind: str, **extra) -> None:
        self.events.append(
            {"contender": self.contender, "step": self.step, "shape": self.shape, "kind": kind, **extra}
        )  # fmt: skip

    def note(self, level: str, message: str) -> None:
        self.messages.append(
            {"contender": self.contender, "step": self.step, "shape": self.shape, "level": level, "message": message}
        )

    def install(self) -> None:
        from ort_trainer.engine.autograd import _session as _autograd_session
        from ort_trainer.module import _graph

        shape_init = _autograd_session._ShapeSession.__init__
        graph_init = _graph.OrtGraph.__init__
        builds = self

        def counted_shape(session, owner, graphs, *, training):
            builds._add("training graph" if training else "eval graph")
            shape_init(session, owner, graphs, training=training)

        def counted_graph(graph, module, example_inputs, kind, *rest, **options):
            graph_init(graph, module, example_inputs, kind, *rest, **options)
            builds._add(kind, symbolic=graph.sizes is not None)

        _autograd_session._ShapeSession.__init__ = counted_shape
        _graph.OrtGraph.__init__ = counted_graph

        class Handler(logging.Handler):
            def emit(self, record):
                text = record.getMessage()
                if record.levelno >= logging.WARNING or "new input shapes" in text or "one graph per" in text:
                    builds.note(record.levelname, text)
                if record.levelno >= logging.WARNING:
                    print(f"[{builds.contender} step {builds.step}] {record.levelname}: {text}", file=sys.stderr)

        log = logging.getLogger("ort_trainer")
        log.addHandler(Handler())
        log.setLevel(logging.INFO)

        class Recompiles(logging.Handler):
            def emit(self, record):
                if "Recompiling" in record.getMessage():
                    builds.note("dynamo", " ".join(record.getMessage().split()))

        torch._logging.set_logs(recompiles=True)  # Dynamo says which guard failed (also on stderr)
        logging.getLogger("torch._dynamo").addHandler(Recompiles())
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            builds.note(category.__name__, str(message))
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show

    def count(self, contender: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for event in self.events:
            if event["contender"] == contender:
                counts[event["kind"]] = counts.get(event["kind"], 0) + 1
        return counts


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ------------------------------------------------------------------------------------------ contenders
def build(name: str, args, first: tuple, builds: Builds) -> tuple:
    """(step function, object to keep alive, first step's loss, seconds of the build + first step)."""
    spec, _, _ = model_spec(args.model, args.batch, "sdpa" if name.endswith("_sdpa") else "eager")
    torch.manual_seed(0)
    model = spec.make()
    if name in DYNAMO:
        _own_forward(model, name)
    keep = None
    with builds.running(name, 0, first):
        start = time.perf_counter()
        if name.startswith("pytorch"):
            step = torch_step(spec, model, copy_model=False)
        elif name == "compile_dynamic":
            step = wrapped_step(spec, model, lambda m: torch.compile(m, dynamic=True), copy_model=False)
        elif name == "compile_ort":
            from ort_trainer.module import ort_backend

            step = wrapped_step(spec, model, lambda m: torch.compile(m, backend=ort_backend), copy_model=False)
        elif name == "ortmodule":
            from ort_trainer import ORTModule

            step = wrapped_step(spec, model, ORTModule, copy_model=False)
        elif name == "ortmodule_marked":
            from ort_trainer import ORTModule

            step = wrapped_step(spec, model, lambda m: _marked(ORTModule(m)), copy_model=False)
        else:
            step, keep = _ort_trainer(spec, model, args.threads)
        loss = float(step(first).detach())
        seconds = time.perf_counter() - start
    del model
    gc.collect()
    return step, keep, loss, seconds


def _ort_trainer(spec: ModelSpec, model: torch.nn.Module, threads: int):
    """ORTTrainer with its defaults (engine "auto"), Adam mode 0 == AdamW, no clipping, ``threads`` intra-op."""
    from ort_trainer import ORTTrainer, optim
    from ort_trainer.config import ORTTrainerOptions
    from ort_trainer.engine._build import session_options_for  # the session options ORTTrainer makes itself

    options = session_options_for(ORTTrainerOptions({}))
    options.intra_op_num_threads = threads
    config = optim.AdamConfig(lr=LR, alpha=BETAS[0], beta=BETAS[1], lambda_coef=WEIGHT_DECAY, epsilon=EPS)
    trainer = ORTTrainer(
        model,
        spec.desc,
        config,
        loss_fn=spec.loss_fn,
        options={"utils": {"grad_norm_clip": False}, "session_options": options},
    )
    return (lambda batch: trainer.train_step(*batch)), trainer


def _own_forward(model: torch.nn.Module, name: str) -> None:
    """Give ``model`` a ``forward`` of its own code object (the same code, renamed): Dynamo keeps its compiled
    graphs, and matches later calls to them, per code object, and its guards do not tell two instances of a class
    apart (their parameters are graph inputs), so one contender would run, or skip, another's graphs."""
    cls = type(model)
    code = cls.forward.__code__.replace(co_name=f"forward_{name}")
    forward = types.FunctionType(code, cls.forward.__globals__, code.co_name, None, cls.forward.__closure__)
    model.__class__ = type(f"{cls.__name__}_{name}", (cls,), {"forward": forward})


def _marked(forward):
    """``forward`` called on copies of its inputs whose every dim is marked dynamic (``mark_dynamic``): Dynamo's
    first graph is then the symbolic one. Copies: the mark stays on a tensor, which the other contenders share."""

    def call(*inputs):
        copies = [x.clone() for x in inputs]
        for x in copies:
            torch._dynamo.mark_dynamic(x, list(range(x.dim())))
        return forward(*copies)

    return call


@contextlib.contextmanager
def dynamo_state(states: dict, name: str):
    """Dynamo's automatic-dynamic record (which dims of a function's inputs changed size: `torch._dynamo.pgo`) of
    this contender alone: every contender compiles the same ``forward``, and one's record would decide another's
    first graph (static or symbolic)."""
    from torch._dynamo import pgo

    saved = pgo._CODE_STATE
    pgo._CODE_STATE = states.setdefault(name, defaultdict(pgo.CodeState))
    try:
        yield
    finally:
        pgo._CODE_STATE = saved


def _fresh_cache(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=f"varlen_cache_{prefix}_")


# ------------------------------------------------------------------------------------------ speed
def run_speed(args, batches: list, builds: Builds) -> dict:
    names = args.contenders.split(",")
    caches = {name: _fresh_cache(name) for name in names}
    steps, keep, rows = {}, [], {}
    states: dict = {}
    for name in names:
        os.environ[_CACHE_ENV] = caches[name]
        dynamo = _dynamo_graphs()
        with dynamo_state(states, name):
            steps[name], obj, loss, seconds = build(name, args, batches[0], builds)
        keep.append(obj)
        rows[name] = {"first_step_s": seconds, "losses": [loss], "wall_ms": [], "cpu_ms": [], "dynamo_graphs": 0}
        rows[name]["dynamo_graphs"] += _dynamo_graphs() - dynamo
        print(f"{name}: first step (build) {seconds:.1f} s, loss {loss:.5f}", file=sys.stderr, flush=True)
    for i in range(1, len(batches)):
        for name in names if i % 2 else reversed(names):
            os.environ[_CACHE_ENV] = caches[name]  # a graph built at a new shape goes to the contender's own cache
            dynamo = _dynamo_graphs()
            with builds.running(name, i, batches[i]), dynamo_state(states, name):
                start, start_cpu = time.perf_counter(), time.process_time()
                loss = float(steps[name](batches[i]).detach())
                wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            row = rows[name]
            row["wall_ms"].append(wall * 1e3)
            row["cpu_ms"].append(cpu * 1e3)
            row["losses"].append(loss)
            row["dynamo_graphs"] += _dynamo_graphs() - dynamo
    for obj in keep:
        if hasattr(obj, "close"):
            obj.close()
    for name, row in rows.items():
        row["ms"] = statistics.median(row["wall_ms"])
        row["cpu"] = statistics.median(row["cpu_ms"])
        row["builds"] = builds.count(name)
        row["build_events"] = [e for e in builds.events if e["contender"] == name]
        row["messages"] = [m for m in builds.messages if m["contender"] == name]
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------------ memory children
def child(args) -> None:
    """Build one contender alone (empty graph cache), run its first --mem-steps batches; print RSS as JSON."""
    os.environ[_CACHE_ENV] = cache = _fresh_cache(args.child)
    builds = Builds()
    builds.install()
    spec, batch, vocab = model_spec(args.model, args.batch)
    batches = make_batches(spec_family(args.model), args.steps, batch, vocab)[: args.mem_steps]
    step, keep, _, seconds = build(args.child, args, batches[0], builds)
    for later in batches[1:]:
        step(later)
    gc.collect()
    result = {"build_s": seconds, "peak": status_kb("VmHWM"), "steady": status_kb("VmRSS")}
    result["shape"] = list(batches[0][0].shape)
    print("RESULT " + json.dumps(result), flush=True)
    del keep
    shutil.rmtree(cache, ignore_errors=True)


def spec_family(name: str) -> str:
    return MODELS[name][0]


def run_children(args) -> dict:
    results = {}
    for name in args.contenders.split(","):
        command = [sys.executable, __file__, "--child", name, "--model", args.model, "--steps", str(args.steps)]
        command += ["--mem-steps", str(args.mem_steps), "--threads", str(args.threads)]
        command += ["--batch", str(args.batch)] if args.batch else []
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{name}: child failed (exit {done.returncode}): {done.stderr.strip()[-400:]}", flush=True)
            continue
        results[name] = json.loads(lines[-1].removeprefix("RESULT "))
        print(f"{name}: peak RSS {results[name]['peak'] / 1024:.0f} MiB", file=sys.stderr, flush=True)
    return results


# ------------------------------------------------------------------------------------------ report
def _modes(name: str, row: dict) -> tuple[str, bool]:
    """The graphs cell and whether the contender built one graph per mode."""
    b, dynamo = row["builds"], row["dynamo_graphs"]
    if name in EAGER:
        return "–", True
    if name == "ort_trainer":
        text = ", ".join(f"{k.split()[0]} {v}" for k, v in b.items())
        return text, b.get("training graph", 0) == 1 and b.get("eval graph", 0) <= 1
    if name == "compile_dynamic":
        return f"dynamo {dynamo}", dynamo == 1
    text = f"fwd {b.get('forward', 0)}, bwd {b.get('backward', 0)} (dynamo {dynamo})"
    return text, b.get("forward", 0) == 1 and b.get("backward", 0) == 1


def _best_eager(rows: dict, key: str) -> float | None:
    return min((rows[n][key] for n in EAGER if n in rows), default=None)


def _slowest(cpu_ms: list[float], shapes: list, scale: list[float] | None = None) -> dict:
    """The later step whose CPU time over ``scale`` (best eager's on the same batch; None: 1) is the highest: its
    step (0-based batch index), shape, CPU ms and that ratio over its median."""
    ratios = [t / (scale[i] if scale else 1.0) for i, t in enumerate(cpu_ms)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return {
        "step": worst + 1,
        "shape": shapes[worst + 1],
        "cpu_ms": cpu_ms[worst],
        "over_median": ratios[worst] / statistics.median(ratios),
    }


def report_rows(speed: dict, memory: dict, shapes: list) -> dict:
    """Per contender: the table's numbers and the goals."""
    eager = [speed[n]["cpu_ms"] for n in EAGER if n in speed]
    scale = [min(times) for times in zip(*eager, strict=True)] if eager else None  # best eager, step by step
    best, best_cpu = (_best_eager(speed, "ms"), _best_eager(speed, "cpu")) if speed else (None, None)
    best_peak = min((memory[n]["peak"] for n in EAGER if n in memory), default=None)
    out = {}
    for name in speed or memory:
        row, mem = speed.get(name), memory.get(name)
        entry: dict = {}
        if row:
            graphs, one = _modes(name, row)
            entry |= {
                "x_best_eager": best / row["ms"] if best else None,
                "x_best_eager_cpu": best_cpu / row["cpu"] if best_cpu else None,
                "graphs": graphs,
                "one_graph_per_mode": one,
                "first_step_s": row["first_step_s"],
                "ms": row["ms"],
                "cpu_ms": row["cpu"],
                "slowest": _slowest(row["cpu_ms"], shapes),  # the slowest later step, over the median
                "spike": _slowest(row["cpu_ms"], shapes, scale),  # the same, each step over best eager's on it
            }
        if mem:
            entry["peak_mib"] = mem["peak"] / 1024
            entry["peak_x_best_eager"] = mem["peak"] / best_peak if best_peak else None
        if name not in EAGER:
            goals = {}
            if row:
                goals["speed"] = entry["x_best_eager_cpu"] is not None and entry["x_best_eager_cpu"] >= 1.0
                goals["builds"] = entry["one_graph_per_mode"]
                goals["spikes"] = entry["spike" if scale else "slowest"]["over_median"] <= 2.0
            if mem and entry.get("peak_x_best_eager") is not None:
                goals["rss"] = entry["peak_x_best_eager"] <= 1.1
            entry["goals"] = goals
        out[name] = entry
    return out


def _f(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def print_table(summary: dict) -> None:
    print(
        "| contender | × best eager (wall) | × best eager (CPU) | graphs built | first step s | ms/step median | "
        "CPU ms/step | slowest later step, CPU ms (step, shape) | ÷ median | worst later step ÷ median, each step "
        "over best eager's (step, shape) | peak RSS MiB | peak × best eager | goals |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, e in summary.items():
        slow, spike = e.get("slowest"), e.get("spike")
        cells = [
            name,
            _f(e.get("x_best_eager")),
            _f(e.get("x_best_eager_cpu")),
            e.get("graphs", "–"),
            _f(e.get("first_step_s"), 1),
            _f(e.get("ms"), 1),
            _f(e.get("cpu_ms"), 1),
            f"{slow['cpu_ms']:.0f} ({slow['step'] + 1}, {'x'.join(map(str, slow['shape']))})" if slow else "–",
            _f(slow["over_median"]) if slow else "–",
            f"{spike['over_median']:.2f} ({spike['step'] + 1}, {'x'.join(map(str, spike['shape']))})" if spike else "–",
            _f(e.get("peak_mib"), 0),
            _f(e.get("peak_x_best_eager")),
            ", ".join(f"{k} {'✓' if ok else '✗'}" for k, ok in e.get("goals", {}).items()) or "–",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


def print_details(speed: dict) -> None:
    """Graphs built after the first step (step, shape, kind) and what the library logged or warned."""
    for name, row in speed.items():
        later = [e for e in row["build_events"] if e["step"] > 0]
        for event in later:
            shape = "x".join(map(str, event["shape"]))
            symbolic = {True: ", symbolic sizes", False: ", static sizes"}.get(event.get("symbolic"), "")
            print(f"- {name}: built a {event['kind']} graph at step {event['step'] + 1} (batch {shape}){symbolic}")
        if name != "compile_dynamic" and row["dynamo_graphs"] > 1:
            print(f"- {name}: Dynamo captured {row['dynamo_graphs']} graphs")
        for message in row["messages"]:
            shape = "x".join(map(str, message["shape"]))
            text = " ".join(message["message"].split())[:400]
            print(f"  - {name} step {message['step'] + 1} ({shape}) {message['level']}: {text}")
    eager = speed.get("pytorch")
    if eager:
        for name, row in speed.items():
            if name in EAGER:
                continue
            diffs = [abs(a - b) for a, b in zip(row["losses"], eager["losses"], strict=True)]
            print(f"- {name}: largest |loss - pytorch's| over the {len(diffs)} steps {max(diffs):.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=None, help="rows per batch (default: the model's)")
    parser.add_argument("--steps", type=int, default=40, help="batches (the first builds, the last is smaller)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"comma-separated from {CONTENDERS}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated from {SECTIONS}")
    parser.add_argument("--mem-steps", type=int, default=3, help="batches each memory child runs (the longest first)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads = ORT intra-op threads")
    parser.add_argument("--json", help="also write the results (per-step losses and times included) to this file")
    parser.add_argument("--from-json", metavar="PATH", help="print the tables of a saved --json run again")
    parser.add_argument("--child", metavar="CONTENDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.from_json:
        render(json.loads(Path(args.from_json).read_text()), again=True)
        return 0
    for name in args.contenders.split(","):
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r}; choose from {CONTENDERS}")
    sections = args.sections.split(",")
    for name in sections:
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; choose from {SECTIONS}")
    if args.steps < 3:
        parser.error("--steps: at least 3 (a build step and two later ones)")
    set_torch_threads(args.threads)
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="varlen_inductor_")  # a cold compile too
    try:
        if args.child:
            child(args)
        else:
            run(args)
    finally:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
        if inductor is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
    return 0


def run(args) -> None:
    spec, batch, vocab = model_spec(args.model, args.batch)
    batches = make_batches(spec_family(args.model), args.steps, batch, vocab)
    shapes = [list(b[0].shape) for b in batches]
    distinct = sorted({tuple(s) for s in shapes}, key=lambda s: (-s[1], -s[0]))
    described = (
        f"model: {spec.summary}; {len(batches)} batches, {len(distinct)} shapes "
        f"({', '.join('x'.join(map(str, s)) for s in distinct)}), first {'x'.join(map(str, shapes[0]))}, "
        f"last {'x'.join(map(str, shapes[-1]))}; torch threads {torch.get_num_threads()}"
    )
    report: dict = {"model": spec.summary, "shapes": shapes, "contenders": args.contenders.split(",")}
    speed, memory, sections = {}, {}, args.sections.split(",")
    if "speed" in sections:
        builds = Builds()
        builds.install()
        speed = run_speed(args, batches, builds)
        gc.collect()
    if "memory" in sections:
        memory = run_children(args)
    report |= {"host": host_stamp(), "described": described, "speed": speed, "memory": memory}
    render(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def render(report: dict, again: bool = False) -> None:
    """The host stamp, the batches, the goals, the table and the details (also from a saved --json: --from-json)."""
    report["summary"] = report_rows(report["speed"], report["memory"], report["shapes"])
    print(report["host"])
    print(report["described"] + "\n")
    print(
        "Goals: steady ≥ 1.0x best eager (CPU); one graph per mode; no later step over 2x the median (each step's CPU "
        "time over best eager's on the same batch); peak RSS (longest batch first) ≤ 1.1x best eager's.\n"
    )
    print_table(report["summary"])
    if report["speed"]:
        print()
        print_details(report["speed"])
    if not again:
        print(f"\nend: {host_stamp().splitlines()[1]}")


if __name__ == "__main__":
    sys.exit(main())
