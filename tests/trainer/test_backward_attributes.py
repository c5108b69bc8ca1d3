"""Attributes that change the backward pass but not the forward: the trainer's *gradients* equal torch's.

A loss comparison cannot see these (the forward is the same): each test reads the gradient of every
parameter from one SGD step with lr 1 and no clipping (weight before - weight after) and compares it with
``param.grad`` of the same step in torch, on both engines. Where the onnxblock engine cannot give torch's
gradient, it refuses, naming the module and the attribute (those tests are onnxblock's only).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.hf_tiny import HF_CLASSIFIER_DESC, BertClassifier, classifier_batch

F = torch.nn.functional
IDS_DESC = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
TOKENS_DESC = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}
X_DESC = {"inputs": [("x", ["batch", 6]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
IDS = torch.tensor([[3, 1, 0, 0], [2, 4, 5, 0], [7, 0, 0, 0]])  # 0 pads: the padding row is read 6 times
LABELS = torch.tensor([0, 2, 1])


ENGINES = [pytest.param("onnxblock", marks=pytest.mark.onnxblock), "autograd"]


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def _trainer(model, desc, loss_fn, engine="onnxblock", lr=0.1):
    options = {"utils": {"grad_norm_clip": False, "engine": engine}}
    return ORTTrainer(model, desc, optim.SGDConfig(lr=lr), loss_fn=loss_fn, options=options)


def ort_gradients(model, desc, loss_fn, *batch, engine):
    """{name: gradient} of one trainer step (SGD, lr 1, no clipping) on a copy of ``model``."""
    options = {"utils": {"grad_norm_clip": False, "engine": engine}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, optim.SGDConfig(lr=1.0), loss_fn=loss_fn, options=options)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.train_step(*batch)
    after = trainer.state_dict(pytorch_format=True)
    return {name: before[name] - after[name] for name in before}


def torch_gradients(model, loss_fn, *batch):
    """{name: grad} of one torch forward/backward on a copy (zeros where torch leaves ``grad`` None)."""
    model = copy.deepcopy(model)
    *inputs, label = batch
    loss_fn(model(*inputs), label).backward()
    return {n: p.grad.to_dense() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def assert_gradients_match(model, desc, loss_fn, *batch, engine, rtol=1e-5):
    got, expected = ort_gradients(model, desc, loss_fn, *batch, engine=engine), torch_gradients(model, loss_fn, *batch)
    for name, grad in expected.items():
        scale = max(grad.abs().max().item(), model.get_parameter(name).abs().max().item())
        error = (got[name] - grad).abs().max().item()
        assert error <= rtol * scale + 1e-7, f"{name}: max error {error:.3g} (max |grad| {grad.abs().max():.3g})"
    return got, expected


class Bag(torch.nn.Module):
    """Token ids -> embedding -> mean over the sequence -> classes (+ an optional tied read of the table)."""

    def __init__(self, vocab=10, dim=4, classes=3, tied=False, **embedding):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim, **embedding)
        self.fc = torch.nn.Linear(dim, classes)
        self.tied = tied

    def forward(self, ids):
        hidden = self.emb(ids)
        logits = self.fc(hidden).mean(1)
        if self.tied:  # an LM head sharing the table: every row, the padding row too, gets this gradient
            logits = logits + (hidden.mean(1) @ self.emb.weight.t())[:, : logits.shape[1]]
        return logits


def _bag(**kwargs):
    torch.manual_seed(0)
    return Bag(**kwargs)


# ----------------------------------------------------------------------------- nn.Embedding(padding_idx=...)
def test_the_padding_row_gets_no_gradient_from_its_lookup(engine):
    """The issue's repro: Embedding(10, 4, padding_idx=0) + Linear; row 0 moved by 0.0795 (torch: exactly 0)."""
    model = _bag(padding_idx=0)
    got, _ = assert_gradients_match(model, IDS_DESC, F.cross_entropy, IDS, LABELS, engine=engine)
    assert torch.count_nonzero(got["emb.weight"][0]) == 0  # the padding row does not move, bit for bit
    assert torch.count_nonzero(got["emb.weight"][1:8]).item() > 0  # the others do


def test_a_tied_head_still_trains_the_padding_row(engine):
    """Zeroing the gradient buffer's row would be wrong here: torch gives row 0 the head's share."""
    model = _bag(padding_idx=0, tied=True)
    got, expected = assert_gradients_match(model, IDS_DESC, F.cross_entropy, IDS, LABELS, engine=engine)
    assert expected["emb.weight"][0].abs().max() > 1e-3  # the head's gradient reaches the padding row
    torch.testing.assert_close(got["emb.weight"][0], expected["emb.weight"][0], rtol=1e-5, atol=1e-7)


def test_a_negative_or_functional_padding_idx_is_torchs_too(engine):
    """padding_idx=-1 is the last row; F.embedding(padding_idx=...) without a module behaves the same."""
    assert_gradients_match(
        _bag(padding_idx=-1), IDS_DESC, F.cross_entropy, IDS.clamp(max=8) + IDS.eq(0) * 9, LABELS, engine=engine
    )

    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 4))
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, ids):
            return self.fc(F.embedding(ids, self.table, padding_idx=0)).mean(1)

    torch.manual_seed(0)
    got, _ = assert_gradients_match(Functional(), IDS_DESC, F.cross_entropy, IDS, LABELS, engine=engine)
    assert torch.count_nonzero(got["table"][0]) == 0


@pytest.mark.onnxblock
def test_mixed_precision_keeps_the_padding_row_out_too():
    """The fp16 graph (casts around what the provider runs in fp16; the no-gradient copy is an ONNX Runtime op
    without an ONNX schema, kept in float32) gives torch's gradients, the padding row's zero included."""
    model = _bag(padding_idx=0)
    options = {"utils": {"grad_norm_clip": False}, "mixed_precision": {"enabled": True}}
    trainer = ORTTrainer(
        copy.deepcopy(model), IDS_DESC, optim.SGDConfig(lr=1.0), loss_fn=F.cross_entropy, options=options
    )
    trainer.train_step(IDS, LABELS)
    step = model.emb.weight.detach() - trainer.state_dict(pytorch_format=True)["emb.weight"]
    expected = torch_gradients(model, F.cross_entropy, IDS, LABELS)["emb.weight"]
    assert torch.count_nonzero(step[0]) == 0
    torch.testing.assert_close(step, expected, rtol=1e-3, atol=1e-5)


def test_the_padding_rows_forward_values_are_torchs_bit_for_bit(engine):
    """The row read without a gradient is the same row: the embedding's output equals torch's exactly."""

    class Out(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 5, padding_idx=0)

        def forward(self, ids):
            return self.emb(ids)

    torch.manual_seed(0)
    model = Out()
    with torch.no_grad():  # values a rounding would show: huge, tiny, subnormal (not -0.0: ORT's Where writes +0.0)
        model.emb.weight[0] = torch.tensor([3.1415927e30, -1.1754944e-38, 0.0, 1e-45, -7.25])
    desc = {
        "inputs": [("ids", ["batch", "seq"]), ("label", ["batch", "seq", 5])],
        "outputs": [("loss", [], True), ("out", ["batch", "seq", 5])],
    }
    trainer = _trainer(copy.deepcopy(model), desc, lambda out, label: ((out - label) ** 2).sum(), engine, lr=0.0)
    _, out = trainer.eval_step(IDS, torch.zeros(3, 4, 5))
    assert torch.equal(out.view(torch.int32), model(IDS).view(torch.int32))  # bit for bit


@pytest.mark.onnxblock
def test_save_as_onnx_writes_the_padding_row_as_a_plain_lookup(tmp_path):
    """The stop-gradient copy is an onnxruntime-training op; the saved eval graph is for any onnxruntime."""
    import onnx
    import onnxruntime as ort

    model = _bag(padding_idx=0, tied=True)
    trainer = _trainer(copy.deepcopy(model), IDS_DESC, F.cross_entropy, lr=0.0)
    trainer.train_step(IDS, LABELS)
    trainer.save_as_onnx(tmp_path / "bag.onnx")
    saved = onnx.load(tmp_path / "bag.onnx")
    assert not [n.op_type for n in saved.graph.node if n.domain not in ("", "ai.onnx")]
    assert not [n.op_type for n in saved.graph.node if n.op_type in ("BatchNormalization", "ConstantOfShape")]
    session = ort.InferenceSession(saved.SerializeToString(), providers=["CPUExecutionProvider"])
    (loss,) = session.run(["loss"], {"ids": IDS.numpy(), "label": LABELS.numpy()})
    assert float(loss) == pytest.approx(F.cross_entropy(model(IDS), LABELS).item(), rel=1e-6)


def test_padded_bert_batches_give_torchs_gradients(engine):
    """The issue: BERT for sequence classification (pad id 0) ended 0.0112 off in row 0 after 20 AdamW steps."""
    torch.manual_seed(0)
    model = BertClassifier(vocab=40)
    batch = classifier_batch(vocab=40)
    assert (batch[0] == model.model.config.pad_token_id).any() and (batch[1] == 0).any()
    got, _ = assert_gradients_match(model, HF_CLASSIFIER_DESC, F.cross_entropy, *batch, rtol=2e-5, engine=engine)
    pad_row = got["model.bert.embeddings.word_embeddings.weight"][model.model.config.pad_token_id]
    assert torch.count_nonzero(pad_row) == 0


# ----------------------------------------------------------------------------- other nn.Embedding attributes
def test_sparse_embeddings_get_torchs_gradient_dense(engine):
    """``Embedding(sparse=True)``: the sparse gradient, summed into the dense weight our optimizers update. The
    autograd engine traces it as the dense backward (the sparse one has a data-dependent shape)."""
    got, _ = assert_gradients_match(
        _bag(sparse=True, padding_idx=0), IDS_DESC, F.cross_entropy, IDS, LABELS, engine=engine
    )
    assert torch.count_nonzero(got["emb.weight"][0]) == 0
    model = _bag(sparse=True)
    _trainer(model, IDS_DESC, F.cross_entropy, engine).train_step(IDS, LABELS)
    assert model.emb.sparse  # the user's module is as they built it


@pytest.mark.onnxblock
@pytest.mark.parametrize(
    "attribute, value", [("max_norm", 1.0), ("scale_grad_by_freq", True)], ids=["max_norm", "scale_grad_by_freq"]
)
def test_embedding_attributes_the_graph_cannot_give_are_refused_naming_the_module(attribute, value):
    trainer = _trainer(_bag(**{attribute: value}), IDS_DESC, F.cross_entropy)
    with pytest.raises(ValueError, match=rf"^emb \(Embedding\) has {attribute}={value}: .*{attribute}"):
        trainer.train_step(IDS, LABELS)


def test_the_autograd_engine_gives_torchs_gradient_for_scale_grad_by_freq():
    """The autograd engine traces torch's own backward: what the onnxblock engine refuses trains as in torch."""
    assert_gradients_match(_bag(scale_grad_by_freq=True), IDS_DESC, F.cross_entropy, IDS, LABELS, engine="autograd")


class _RenormedTable(torch.nn.Module):
    """``F.embedding(..., max_norm=1.0)``, or a forward that clamps a parameter in place itself."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.table = torch.nn.Parameter(torch.randn(10, 4) * 3)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        if self.how == "functional":
            rows = F.embedding(ids, self.table, max_norm=1.0)
        else:
            with torch.no_grad():
                self.table.clamp_(-1.0, 1.0)
            rows = F.embedding(ids, self.table)
        return self.head(rows.mean(1))


@pytest.mark.parametrize("how", ["module", "functional", "in-place"])
def test_a_forward_that_writes_a_parameter_is_refused_by_the_autograd_engine(how):
    """torch renormalises (``max_norm``) or clamps the parameter itself during forward; a graph that only returns
    gradients would silently skip that write (the weight was 1.23 off torch's after one SGD step): refused,
    naming the parameter, before any step runs."""
    torch.manual_seed(0)
    model = _bag(max_norm=1.0) if how == "module" else _RenormedTable(how)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, IDS_DESC, F.cross_entropy, engine="autograd")
    name = "emb" if how == "module" else "table"
    expected = r"emb \(Embedding\) has max_norm=1.0" if how == "module" else rf"writes the parameter {name!r} in place"
    with pytest.raises(ValueError, match=expected):
        trainer.train_step(IDS, LABELS)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.onnxblock
def test_functional_scale_grad_by_freq_is_refused():
    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 4))

        def forward(self, ids):
            return F.embedding(ids, self.table, scale_grad_by_freq=True).mean(1)[:, :3]

    trainer = _trainer(Functional(), IDS_DESC, F.cross_entropy)
    with pytest.raises(ValueError, match=r"scale_grad_by_freq=True.*scale_grad_by_freq=False"):
        trainer.train_step(IDS, LABELS)


# ----------------------------------------------------------------------------- losses
@pytest.mark.parametrize(
    "loss_kwargs",
    [
        {"ignore_index": 0},
        {"ignore_index": -100},
        {"label_smoothing": 0.2},
        {"ignore_index": 0, "label_smoothing": 0.1},
    ],
    ids=["ignore_index=0", "ignore_index=-100", "label_smoothing", "both"],
)
def test_cross_entropy_attributes_give_torchs_gradients(loss_kwargs, engine):
    """Labels equal to ignore_index contribute nothing (and leave the mean's denominator); smoothing spreads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    labels = torch.tensor([[1, 0, 0, 2], [0, 4, 5, 0], [7, 0, 3, 0]])
    if loss_kwargs.get("ignore_index") == -100:
        labels = labels.masked_fill(labels == 0, -100)

    def loss_fn(logits, label):
        return F.cross_entropy(logits.reshape(-1, 10), label.reshape(-1), **loss_kwargs)

    assert_gradients_match(model, TOKENS_DESC, loss_fn, IDS, labels, engine=engine)


# ----------------------------------------------------------------------------- what the module keeps out of the graph
class Gated(torch.nn.Module):
    """``first``'s output reaches the loss twice: through ``second``, and through ``third`` in a way set by ``mode``.

    "detach" / "no_grad": torch gives ``first`` no gradient through ``third`` (which still trains through its
    own direct use); "buffer": a frozen float buffer scales the path instead, and gradients flow both ways.
    """

    def __init__(self, mode: str):
        super().__init__()
        self.first, self.second, self.third = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.mode = mode

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        if self.mode == "detach":
            aside = self.third(hidden.detach())
        elif self.mode == "no_grad":
            with torch.no_grad():
                aside = self.third(hidden)
        else:
            aside = self.third(hidden * self.scale)
        return self.second(hidden) + aside + self.third(x)


@pytest.mark.parametrize("mode", ["buffer", "detach", "no_grad"])
def test_what_the_module_keeps_out_of_the_backward_gets_no_gradient_there(mode, engine):
    torch.manual_seed(0)
    x, label = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    assert_gradients_match(Gated(mode), X_DESC, F.cross_entropy, x, label, engine=engine)


class Teacher(torch.nn.Module):
    """A frozen teacher under ``torch.no_grad`` (distillation), and a parameter used nowhere else but there."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
        self.teacher.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(torch.tanh(self.student.weight.sum() * x))
        return self.student(x) + target


def test_a_frozen_teacher_under_no_grad_trains_like_torch(engine):
    torch.manual_seed(0)
    assert_gradients_match(
        Teacher(), X_DESC, F.cross_entropy, torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0]), engine=engine
    )


@pytest.mark.onnxblock
def test_a_trainable_parameter_used_only_under_no_grad_is_not_trained_silently():
    """torch leaves its grad None; onnxblock cannot leave a trained weight out of the gradient: it must say so."""
    model = Gated("no_grad")
    model.forward = lambda x: model.second(torch.tanh(model.first(x))) + _no_grad(model.third, x)
    trainer = _trainer(model, X_DESC, F.cross_entropy)
    with pytest.raises(RuntimeError, match=r"third\.(weight|bias)"):
        trainer.train_step(torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0]))


def _no_grad(module, x):
    with torch.no_grad():
        return module(x)


def test_frozen_parameters_get_no_gradient_and_the_rest_torchs(engine):
    torch.manual_seed(0)
    model = Gated("buffer")
    model.first.weight.requires_grad_(False)
    x, label = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    got, _ = assert_gradients_match(model, X_DESC, F.cross_entropy, x, label, engine=engine)
    assert torch.count_nonzero(got["first.weight"]) == 0


class _HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward (the gradient-scaling trick of fairseq's GradMultiply)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class WithFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.second(_HalfGradient.apply(torch.tanh(self.first(x))))  # torch: first's gradient halved


@pytest.mark.onnxblock
def test_a_custom_autograd_function_is_refused_naming_it():
    """Its backward is not the forward's derivative, which is all a traced graph knows: refused, not trained."""
    trainer = _trainer(WithFunction(), X_DESC, F.cross_entropy)
    with pytest.raises(TypeError, match=r"torch\.autograd\.Function \S*_HalfGradient: .*backward"):
        trainer.train_step(torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0]))


def test_the_autograd_engine_gives_a_custom_functions_own_backward():
    """What the onnxblock engine's refusal points to: traced from torch's autograd, the Function's backward runs."""
    torch.manual_seed(0)
    got, expected = assert_gradients_match(
        WithFunction(), X_DESC, F.cross_entropy, torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0]), engine="autograd"
    )
    assert expected["first.weight"].abs().max() > 0
