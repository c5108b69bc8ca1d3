"""The zoo: real Hugging Face architectures from tiny configs train on ORT as in PyTorch.

Each row: 5 AdamW steps on ORT and in eager PyTorch from the same initial weights; losses and final
weights compared (tolerances of tests/interop/test_interop_hf.py). Token batches are padded, the pad id among the
real tokens too (architectures.py); GPT-2 and Mixtral get no attention mask and no cache (transformers then
checks for packed sequences with torch.diff), Llama, Mistral and Qwen2 a mask; CLIP's loss averages two
cross-entropies over constant labels (ScaledSum). Models whose loss cannot be exported fail at the
first step with an error that names the op, the module and the way out. Run by ``make test-zoo``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph.autograd import TraceError
from tests.zoo.architectures import ARCHITECTURES, Architecture, mixtral

pytestmark = pytest.mark.zoo

STEPS = 5
LR, DECAY, EPS = 1e-3, 0.01, 1e-5  # eps 1e-5: see tests/interop/test_interop_hf.py
# CLIP's one-layer text tower: the loss does not depend on the key bias and barely on q/k, so their gradients
# are rounding noise that Adam scales up to +-lr (torch 5e-6 vs ORT 0 on k_proj.bias; q/k weights 2e-5 apart
# while the losses agree to 1e-7)
# Wav2Vec2 CTC: the CTC gradient comes from the unrolled alpha recursion (log-sum-exp per frame), summed in
# another order than torch's alpha-beta gradient; the losses (~280, reduction "sum") agree to 1e-7 relative
WEIGHT_ATOL = {"clip": 5e-5, "wav2vec2-ctc": 1e-4}
# the autograd engine's gradients are torch's formulas; CLIP's q/k noise (above) is the same on both engines
AUTOGRAD_WEIGHT_ATOL = {"clip": 5e-5}
# What the autograd engine cannot train yet (torch 2.13, onnxscript 0.7.2, onnxruntime 1.31.1), each refused at the
# first step with the error a user gets (docs/engines.md): Mixtral's expert loop and Wav2Vec2-CTC's label check
# are Python control flow on tensor values.
AUTOGRAD_REFUSED = {
    "mixtral": r"could not trace the training graph of MixtralForCausalLM at .*for expert_idx in expert_hit",
    "wav2vec2-ctc": r"could not trace the training graph of Wav2Vec2ForCTC at .*labels\.max\(\)",
}


# The onnxblock engine on every architecture (where onnxruntime-training is installed); the autograd engine here only
# where it refuses the family: every family it trains is checked against eager PyTorch, losses and weights, by
# `test_one_symbolic_graph_trains_like_torch_at_every_shape` below, whose one graph serves every shape (a fixed
# shape is one of them).
ENGINE_CASES = [pytest.param(name, "onnxblock", marks=pytest.mark.onnxblock) for name in sorted(ARCHITECTURES)]
ENGINE_CASES += [(name, "autograd") for name in sorted(AUTOGRAD_REFUSED)]


def _trainer(model: torch.nn.Module, arch: Architecture, engine: str = "auto") -> ORTTrainer:
    options = {"utils": {"grad_norm_clip": False, "engine": engine}, "debug": {"deterministic_compute": True}}
    return ORTTrainer(model, arch.desc, optim.AdamConfig(lr=LR, lambda_coef=DECAY, epsilon=EPS), options=options)


def _torch_losses(model: torch.nn.Module, arch: Architecture, batches) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, eps=EPS)
    names = [name for name, _ in arch.inputs]
    model.train()
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(**dict(zip(names, batch, strict=True)))[0]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("name", "engine"), ENGINE_CASES)
def test_the_architecture_trains_like_torch(name, engine):
    arch = ARCHITECTURES[name]()
    g = torch.Generator().manual_seed(1)
    batches = [arch.batch(g) for _ in range(STEPS)]
    torch.manual_seed(0)
    model = arch.build()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, arch, engine)
    if engine == "autograd" and name in AUTOGRAD_REFUSED:
        with pytest.raises(TraceError, match=AUTOGRAD_REFUSED[name]):
            trainer.train_step(*batches[0])
        return
    losses = [trainer.train_step(*batch).item() for batch in batches]
    expected = _torch_losses(reference, arch, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    weights = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        if key in weights:
            atol = WEIGHT_ATOL.get(name, 1e-5) if engine == "onnxblock" else AUTOGRAD_WEIGHT_ATOL.get(name, 1e-5)
            torch.testing.assert_close(weights[key], value, atol=atol, rtol=1e-4, msg=f"{name}: {key}")


@pytest.mark.onnxblock
def test_what_cannot_be_exported_says_what_to_do():
    arch = mixtral("grouped_mm")
    torch.manual_seed(0)
    trainer = _trainer(arch.build(), arch)
    with pytest.raises(
        NotImplementedError, match=r"aten::_grouped_mm \(used by .*experts \(MixtralExperts\)\).*'eager'"
    ):
        trainer.train_step(*arch.batch(torch.Generator().manual_seed(1)))


# ORTModule (issue R): the user's own AdamW loop over ORTModule(model), or over torch.compile(model,
# backend="ort_trainer"), against the same loop in eager PyTorch. ORTModule captures the forward as one graph
# (fullgraph); these raise at the first call naming the line (docs/ortmodule.md). The compile backend runs the
# code around a graph break in eager PyTorch and every captured piece in ONNX Runtime.
ORTMODULE_REFUSED = {
    "mixtral": r"MixtralForCausalLM\.forward as one graph at .*modeling_mixtral\.py:\d+ \(for expert_idx in expert_hit",
    "wav2vec2-ctc": r"Wav2Vec2ForCTC\.forward as one graph at .*modeling_wav2vec2\.py:\d+ \(if labels is not None and "
    r"labels\.max\(\)",
    # transformers installs its output-capturing hooks on the first call, under a threading.Lock
    "wav2vec2": r"Wav2Vec2ForSequenceClassification\.forward as one graph at .*output_capturing\.py:\d+ "
    r"\(with _hook_installation_lock",
}
COMPILE_REFUSED: dict[str, str] = {}  # Mixtral: its expert loop's graphs get symbolic sizes and run eager (warned)
# ORTModule is torch.compile(module, backend="ort_trainer", fullgraph=True): on a family Dynamo captures as one graph,
# the compile wrapper builds the very graphs ORTModule builds. It runs where the two differ, the families ORTModule
# refuses (graph breaks: the code between the graphs runs eager), and on GPT-2, one whole-graph family for the
# wrapper's own path (~1/3 of the wrapped tests' time saved in CI).
COMPILE_FAMILIES = sorted({*ORTMODULE_REFUSED, "gpt2"})
WRAPPED_CASES = [(name, "ortmodule") for name in sorted(ARCHITECTURES)] + [(n, "compile") for n in COMPILE_FAMILIES]


def _custom_loop(module: torch.nn.Module, arch: Architecture, batches) -> list[float]:
    """The loop a PyTorch user writes: torch's AdamW, zero_grad, backward, step (the same as `_torch_losses`)."""
    return _torch_losses(module, arch, batches)


@pytest.mark.parametrize(("name", "wrapper"), WRAPPED_CASES)
def test_a_custom_adamw_loop_over_the_wrapped_architecture_equals_eager(name, wrapper, caplog):
    from ort_trainer import ORTModule
    from ort_trainer.module import ort_backend

    torch._dynamo.reset()  # Dynamo's per-code recompile limit is shared by every model: past it, code runs eager
    arch = ARCHITECTURES[name]()
    g = torch.Generator().manual_seed(1)
    batches = [arch.batch(g) for _ in range(STEPS)]
    torch.manual_seed(0)
    model = arch.build()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model) if wrapper == "ortmodule" else torch.compile(model, backend=ort_backend)
    refused = (ORTMODULE_REFUSED if wrapper == "ortmodule" else COMPILE_REFUSED).get(name)
    if refused:
        with pytest.raises(TraceError, match=refused):
            _custom_loop(wrapped, arch, batches[:1])
        return
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        losses = _custom_loop(wrapped, arch, batches)
    ran = [r for r in caplog.records if r.getMessage().startswith(("ORT forward graph", "ORT backward graph"))]
    assert len(ran) >= 2, "no graph was compiled to ONNX Runtime"
    expected = _torch_losses(reference, arch, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    weights = model.state_dict()
    for key, value in reference.state_dict().items():
        atol = AUTOGRAD_WEIGHT_ATOL.get(name, 1e-5)
        torch.testing.assert_close(weights[key], value, atol=atol, rtol=1e-4, msg=lambda m, k=key: f"{name}: {k}: {m}")


# Issue V: the zoo at varying shapes. Every batch has its own batch size and (padded) lengths, as a collator pads
# each batch to its longest example and an epoch ends in a smaller batch; the autograd engine serves them all from one
# symbolic graph (the dims model_desc names: batch, seq, target) and trains equal to eager PyTorch at every shape.
# each step's size of each named dim: batches of 2, 3 and 1 rows (an epoch's last), lengths up and down
SIZES = {"batch": [2, 3, 1, 2, 3], "seq": [8, 6, 5, 7, 8], "target": [6, 5, 4, 3, 6]}
# families whose code makes a named dim static: one graph per size of it (said once, with the line); none today
PER_SHAPE: dict[str, str] = {}


def _resized(tensor: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """``tensor`` with ``size`` entries along ``axis``: its own rows repeated, then cut (ids and labels stay valid;
    a cut sequence loses its padding tail, so some batches are padded and some are not)."""
    repeats = -(-size // tensor.shape[axis])
    return torch.cat([tensor] * repeats, dim=axis).narrow(axis, 0, size).contiguous()


def varied_batches(arch: Architecture, g: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    batches = []
    for step in range(len(SIZES["batch"])):
        batch = []
        for (_, dims), tensor in zip(arch.inputs, arch.batch(g), strict=True):
            for axis, dim in enumerate(dims):
                if isinstance(dim, str):
                    tensor = _resized(tensor, axis, SIZES[dim][step])
            batch.append(tensor)
        batches.append(tuple(batch))
    return batches


@pytest.mark.parametrize("name", sorted(set(ARCHITECTURES) - set(AUTOGRAD_REFUSED)))
def test_one_symbolic_graph_trains_like_torch_at_every_shape(name, caplog):
    arch = ARCHITECTURES[name]()
    batches = varied_batches(arch, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = arch.build()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, arch, "autograd")
    caplog.set_level(logging.INFO, logger="ort_trainer")
    losses = [trainer.train_step(*batch).item() for batch in batches]
    expected = _torch_losses(reference, arch, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    weights = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        if key in weights:
            atol = AUTOGRAD_WEIGHT_ATOL.get(name, 1e-5)
            torch.testing.assert_close(weights[key], value, atol=atol, rtol=1e-4, msg=f"{name}: {key}")
    reference.eval()
    names = [n for n, _ in arch.inputs]
    for batch in batches[:3]:  # eval batches of other sizes: one eval graph too
        with torch.no_grad():
            want = reference(**dict(zip(names, batch, strict=True)))[0]
        torch.testing.assert_close(trainer.eval_step(*batch), want, atol=1e-5, rtol=1e-5)
    shapes = {tuple(tuple(t.shape) for t in batch) for batch in batches}
    builds = caplog.text.count("new input shapes")
    if name in PER_SHAPE:
        assert builds == len(shapes) - 1
    else:
        assert builds == 0, f"{name}: {builds} graphs built after the first for {len(shapes)} shapes"
