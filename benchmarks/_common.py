"""Shared pieces of the benchmarks: models, thread settings, the contenders' step functions.

Every contender trains the same model from the same initial weights with the same AdamW
hyper-parameters (lr 1e-3, betas 0.9/0.999, eps 1e-6, weight decay 0, bias correction, no gradient
clipping: the defaults of ``onnxblock.optim.AdamW``, which ``artifacts.OptimType.AdamW`` uses, and
which has no ``clip_grad``). Dropout is 0. Threads: ``torch.set_num_threads(T)`` and ONNX Runtime
``intra_op_num_threads=T``, ``inter_op_num_threads=1`` (sequential executor), spinning left at ORT's
default unless told otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from benchmarks._isa import isa_stamp, mkl_isa
from ort_trainer import ORTTrainer, optim
from ort_trainer.config.model_desc import validate_model_desc
from ort_trainer.graph._weightless import with_values
from ort_trainer.graph.onnxblock import apply_forward_rewrites, apply_training_rewrites
from ort_trainer.graph.onnxblock._export import export_torch_model
from ort_trainer.graph.onnxblock._gradient_fixes import expand_where_inputs
from ort_trainer.graph.onnxblock._passes import add_optional_outputs
from ort_trainer.runtime._native_logs import quiet_native_info_logs

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-6, 0.0
MLP_DESC = {"inputs": [("x", ["batch", "features"]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
LM_DESC = {"inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}


# ------------------------------------------------------------------------------------------ host stamp
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
_ISA_ENV = (
    "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
    "LD_PRELOAD", "GLIBC_TUNABLES",
)  # fmt: skip
_PACKAGES = ("torch", "onnxruntime", "onnxruntime-training", "onnx", "onnxscript", "transformers", "numpy")


def _cpu_info() -> tuple[str, set[str]]:
    """(CPU model name, ISA flags) from /proc/cpuinfo; ("unknown", {}) where there is none."""
    model, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in ("unknown", "", platform.machine()):
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def host_stamp() -> str:
    """One block naming the host a benchmark table was measured on: print it above every table.

    CPU model, the ISA flags that decide which GEMM/element-wise kernels run (avx2, avx512f, avx512_bf16,
    amx...; under ``--isa avx2`` the emulated ISA, `benchmarks._isa`), the kernels torch and MKL chose,
    cores (and the affinity this process has), the 1/5/15-minute load average, library versions, ISA/thread
    environment overrides (LD_PRELOAD, GLIBC_TUNABLES included), the date and the exact command.
    """
    model, flags = _cpu_info()
    isa = " ".join(f for f in _ISA_FLAGS if f in flags) or "none of " + "/".join(_ISA_FLAGS)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    versions = ", ".join(f"{p} {_version(p)}" for p in _PACKAGES)
    overrides = ", ".join(f"{k}={os.environ[k]}" for k in _ISA_ENV if k in os.environ) or "none"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    return "\n".join(
        [
            f"host: {model}; {isa_stamp(isa)}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"MKL {mkl_isa()}",
            f"cores: {os.cpu_count()} ({affinity} usable); load average {load} (1/5/15 min) at {when}",
            f"versions: python {platform.python_version()}, {versions}; env overrides: {overrides}",
            f"command: {command}",
        ]
    )


def status_kb(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmHWM``: peak RSS, ``VmRSS``: RSS now, ``RssAnon``...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def print_host_stamp() -> None:
    """Print `host_stamp` and a blank line: the first lines of every benchmark's output."""
    print(host_stamp() + "\n", flush=True)


# ------------------------------------------------------------------------------------------ models
class MLP(torch.nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class LM(torch.nn.Module):
    """Embedding + post-norm transformer encoder layers + vocabulary head (tests.models.TinyLM, bigger)."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, ff: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=ff, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def lm_loss(logits, label):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


@dataclass
class ModelSpec:
    name: str
    summary: str
    make: Callable[[], torch.nn.Module]
    desc: dict
    loss_fn: Callable
    batches: Callable[[int], list[tuple[torch.Tensor, ...]]]  # n -> n distinct (inputs..., label)


def _mlp_batches(n: int, batch: int = 256, d_in: int = 784, classes: int = 10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def _lm_batches(n: int, batch: int = 8, seq: int = 128, vocab: int = 8000):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


MODELS = {
    "mlp": ModelSpec(
        "mlp",
        "MLP 784-1024-10, batch 256, 0.81M params, cross-entropy",
        lambda: MLP(784, 1024, 10),
        MLP_DESC,
        torch.nn.functional.cross_entropy,
        _mlp_batches,
    ),
    "lm": ModelSpec(
        "lm",
        "LM vocab 8000, d_model 256, 2 layers, 4 heads, ff 512, batch 8 x seq 128, 5.16M params",
        lambda: LM(8000, 256, 2, 4, 512),
        LM_DESC,
        lm_loss,
        _lm_batches,
    ),
}


# ------------------------------------------------------------------------------------------ threads
def set_torch_threads(threads: int) -> None:
    torch.set_num_threads(threads)


OPT_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def session_options(
    threads: int,
    spinning: bool | None = None,
    profile_prefix: str | None = None,
    opt_level: str = "all",
    stop_spinning: bool = False,
) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = OPT_LEVELS[opt_level]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if stop_spinning:  # spin inside Run(), stop when it returns (the torch optimizer runs next)
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


# ------------------------------------------------------------------------------------------ rewrites
@contextlib.contextmanager
def graph_rewrites(enabled: bool) -> Iterator[None]:
    """Force the CPU speed rewrites (forward and training graph) on or off while an `ORTTrainer` builds."""
    import ort_trainer.engine.onnxblock._build as onnxblock_build  # the onnxblock wing applies them (issue X)

    saved = onnxblock_build.apply_forward_rewrites, onnxblock_build.apply_training_rewrites
    if not enabled:
        onnxblock_build.apply_forward_rewrites = onnxblock_build.apply_training_rewrites = lambda model, *threads: 0
    try:
        yield
    finally:
        onnxblock_build.apply_forward_rewrites, onnxblock_build.apply_training_rewrites = saved


# ------------------------------------------------------------------------------------------ contenders
Step = Callable[[tuple[torch.Tensor, ...]], object]


def torch_step(spec: ModelSpec, model: torch.nn.Module, adamw: str = "fused", copy_model: bool = True) -> Step:
    """Eager PyTorch: zero_grad(set_to_none) + forward + loss + backward + AdamW.

    ``copy_model=False`` trains ``model`` itself (a memory measurement must not hold a second copy)."""
    model = (copy.deepcopy(model) if copy_model else model).train()
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[adamw]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kind)

    def step(batch):
        *inputs, label = batch
        opt.zero_grad(set_to_none=True)
        loss = spec.loss_fn(model(*inputs), label)
        loss.backward()
        opt.step()
        return loss

    return step


def compiled_step(spec: ModelSpec, model: torch.nn.Module, copy_model: bool = True, backend: str = "inductor") -> Step:
    """``torch.compile(model, backend=...)`` (inductor, default mode) for forward + backward; the fused AdamW
    stays eager. ``backend="ort_trainer"``: the graphs Dynamo captures run in ONNX Runtime."""
    if backend == "ort_trainer":
        from ort_trainer.module import ort_backend  # the entry point's target, whether or not it is installed

        return wrapped_step(spec, model, lambda m: torch.compile(m, backend=ort_backend), copy_model)
    return wrapped_step(spec, model, lambda m: torch.compile(m, backend=backend), copy_model)


def wrapped_step(spec: ModelSpec, model: torch.nn.Module, wrap, copy_model: bool = True) -> Step:
    """The eager loop (zero_grad, forward, loss, backward, fused AdamW) over ``wrap(model)`` (a compiled module,
    `ORTModule`): only forward + backward change hands."""
    model = (copy.deepcopy(model) if copy_model else model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    forward = wrap(model)

    def step(batch):
        *inputs, label = batch
        opt.zero_grad(set_to_none=True)
        loss = spec.loss_fn(forward(*inputs), label)
        loss.backward()
        opt.step()
        return loss

    return step


def ort_trainer_step(
    spec: ModelSpec,
    model: torch.nn.Module,
    options: ort.SessionOptions,
    rewrites: bool,
    first: tuple,
    utils: dict | None = None,
    copy_model: bool = True,
) -> tuple[Step, ORTTrainer]:
    """ORTTrainer (Adam mode 0 == AdamW); the engine is built by running one step on ``first``.

    ``utils``: extra ``options["utils"]`` entries (e.g. ``{"shrink_memory_arena": True}``); ``copy_model=False``
    hands ``model`` itself to the trainer (as a user does; a memory measurement must not hold a copy)."""
    config = optim.AdamConfig(lr=LR, alpha=BETAS[0], beta=BETAS[1], lambda_coef=WEIGHT_DECAY, epsilon=EPS)
    trainer = ORTTrainer(
        copy.deepcopy(model) if copy_model else model,
        spec.desc,
        config,
        loss_fn=spec.loss_fn,
        options={"utils": {"grad_norm_clip": False, **(utils or {})}, "session_options": options},
    )
    with graph_rewrites(rewrites):
        trainer.train_step(*first)
    return (lambda batch: trainer.train_step(*batch)), trainer


def forward_graph(
    spec: ModelSpec, model: torch.nn.Module, sample: tuple, rewrites: bool
) -> tuple[onnx.ModelProto, list]:
    """The forward ONNX graph exactly as ORTTrainer builds it (export + graph passes), and its parameters."""
    desc = validate_model_desc(spec.desc, require_loss=True)
    exported = export_torch_model(copy.deepcopy(model), spec.loss_fn, desc, sample, 17)
    forward = with_values(exported.model, model.state_dict())  # the export carries shapes only: add the weights
    if rewrites:
        apply_forward_rewrites(forward)
    add_optional_outputs(forward)
    present = {init.name for init in forward.graph.initializer}
    params = [
        n
        for n in dict.fromkeys(exported.fqn_to_onnx.values())
        if n in present and n not in exported.buffers | exported.no_grad
    ]
    expand_where_inputs(forward, set(params))  # as ORTTrainer's build does
    return forward, params


@contextlib.contextmanager
def _gradient_fixes_in_onnxblock() -> Iterator[None]:
    """ORTTrainer's fix for ORT's broadcast-gradient bug (`_gradient_fixes.forget_unnamed_dims`), also for the
    bare loop's ``generate_artifacts``: without it HF BERT's gradient graph aborts the process."""
    from onnxruntime.training.onnxblock import blocks

    from ort_trainer.graph.onnxblock._gradient_fixes import forget_unnamed_dims

    original = blocks.Block.infer_shapes_on_base
    blocks.Block.infer_shapes_on_base = lambda self: forget_unnamed_dims(original(self))
    try:
        yield
    finally:
        blocks.Block.infer_shapes_on_base = original


class BareOrt:
    """The on-device training API loop: generate_artifacts(AdamW) + Module + Optimizer + CheckpointState."""

    def __init__(self, spec: ModelSpec, model: torch.nn.Module, options: ort.SessionOptions, rewrites: bool, first):
        from onnxruntime.training import artifacts
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        forward, params = forward_graph(spec, model, first, rewrites)
        self._dir = tempfile.TemporaryDirectory(prefix="bare_ort_")
        out = Path(self._dir.name)
        with quiet_native_info_logs(), _gradient_fixes_in_onnxblock():
            artifacts.generate_artifacts(
                forward,
                requires_grad=params,
                frozen_params=[],
                loss=None,  # the exported graph's first output already is the loss
                optimizer=artifacts.OptimType.AdamW,  # betas 0.9/0.999, eps 1e-6, weight decay 0, no clip_grad
                artifact_directory=out,
            )
        if rewrites:  # the same training-graph rewrites ORTTrainer applies
            training = onnx.load(str(out / "training_model.onnx"))
            apply_training_rewrites(training, options.intra_op_num_threads or (os.cpu_count() or 1))
            onnx.save(training, str(out / "training_model.onnx"))
        self.state = CheckpointState.load_checkpoint(str(out / "checkpoint"))
        self.module = Module(str(out / "training_model.onnx"), self.state, str(out / "eval_model.onnx"), "cpu", options)
        self.optimizer = Optimizer(str(out / "optimizer_model.onnx"), self.module)
        self.optimizer.set_learning_rate(LR)
        self.module.train()
        self.step(first)

    def step(self, batch):
        loss = self.module(*[t.numpy() for t in batch])
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return loss

    def close(self):
        self._dir.cleanup()
