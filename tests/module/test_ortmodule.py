"""`ORTModule` in a plain PyTorch loop equals the same loop in eager PyTorch.

Each test runs the wrapped module and a deep copy of it in eager PyTorch from the same weights, the same
batches and the same seed of torch's generator, and compares losses, ``param.grad`` and weights (PyTorch is
the reference). Dropout is on where the module has it: the masks are drawn from torch's generator as eager
PyTorch draws them on CPU, so the two runs see the same masks.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ort_trainer import ORTModule
from ort_trainer.graph.autograd import TraceError
from ort_trainer.runtime import DLPACK_ROUTE
from tests.hf_tiny import tiny_gpt2_config
from tests.models import CNN, MLP, KthValue, TinyLM, cnn_batches, lm_batches, lm_loss, mlp_batches


def _assert_grads_equal(module: torch.nn.Module, reference: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _adamw_losses(module, batches, loss_fn, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for inputs, label in batches:
        opt.zero_grad()
        loss = loss_fn(module(inputs), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_transformer_with_dropout_trains_as_in_eager_over_five_adamw_steps():
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1)
    reference = copy.deepcopy(model)
    batches = lm_batches(5)
    losses = _adamw_losses(ORTModule(model), batches, lm_loss)
    after = torch.rand(3)  # torch's generator is where eager leaves it: ORT drew the masks eager draws
    expected = _adamw_losses(reference, batches, lm_loss)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert torch.equal(after, torch.rand(3))
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if name.endswith("in_proj_bias"):  # the key bias: softmax ignores it, its gradient is rounding noise
            p, q = torch.cat([p[:16], p[32:]]), torch.cat([q[:16], q[32:]])  # that Adam scales up to +-lr
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_gradients_land_in_param_grad_for_accumulation_clipping_and_any_optimizer():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    batches = mlp_batches(4)
    runs = []
    for module in (wrapped, reference):
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        runs.append((module, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)))
    for step in range(0, 4, 2):  # two micro-batches per update
        for module, opt, _ in runs:
            opt.zero_grad(set_to_none=True)
            for x, label in batches[step : step + 2]:
                (torch.nn.functional.cross_entropy(module(x), label) / 2).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=0.5)
        _assert_grads_equal(model, reference)
        for _, opt, scheduler in runs:
            opt.step()
            scheduler.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_eval_no_grad_and_a_new_batch_size_get_their_own_graphs():
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    tokens, _ = lm_batches(1)[0]
    wrapped.eval()
    reference.eval()
    assert not model.training
    torch.testing.assert_close(wrapped(tokens), reference(tokens), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        out = wrapped(tokens)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, reference(tokens), atol=1e-5, rtol=1e-5)
    wrapped.train()
    reference.train()
    longer, _ = lm_batches(1, batch=3, seq=5)[0]  # another batch and sequence size
    torch.manual_seed(1)
    got = wrapped(longer)
    got.sum().backward()
    torch.manual_seed(1)
    expected = reference(longer)
    expected.sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    _assert_grads_equal(model, reference, atol=1e-5)


def test_batchnorm_running_statistics_update_as_in_eager():
    torch.manual_seed(0)
    model = CNN()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for x, label in cnn_batches(2):
        torch.nn.functional.cross_entropy(wrapped(x), label).backward()
        torch.nn.functional.cross_entropy(reference(x), label).backward()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(
            model.state_dict()[key], value, atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )
    _assert_grads_equal(model, reference)


def test_state_dict_keys_are_the_modules_own_also_under_a_parent():
    model = MLP()
    wrapped = ORTModule(model)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    fresh = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    wrapped.load_state_dict(fresh)
    assert torch.equal(model.fc1.weight, torch.full_like(model.fc1.weight, 0.5))
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "fc2.bias"'):
        wrapped.load_state_dict({k: v for k, v in fresh.items() if k != "fc2.bias"})
    parent = torch.nn.ModuleDict({"net": ORTModule(MLP())})  # as DistributedDataParallel holds it
    keys = list(parent.state_dict())
    assert keys == [f"net.{k}" for k in model.state_dict()]
    result = parent.load_state_dict({f"net.{k}": v for k, v in fresh.items() if k != "fc1.bias"}, strict=False)
    assert result.missing_keys == ["net.fc1.bias"] and result.unexpected_keys == []
    assert torch.equal(parent["net"].module.fc2.weight, fresh["fc2.weight"])


@pytest.mark.zoo  # a Hugging Face model (~8 s): run by `make test-zoo` beside the zoo's ORTModule rows
def test_a_hugging_face_model_takes_labels_and_returns_its_model_output():
    import transformers

    torch.manual_seed(0)
    config = tiny_gpt2_config(64)
    config.n_layer = 1
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 64, (2, 8))
    out = ORTModule(model)(input_ids=ids, labels=ids)
    expected = reference(input_ids=ids, labels=ids)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    expected.loss.backward()
    _assert_grads_equal(model, reference, atol=1e-5)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # Python control flow on a tensor value
            return y * 2
        return y


def test_what_cannot_run_in_onnx_runtime_raises_at_the_first_call_naming_the_line_and_the_way_out():
    x = torch.randn(3, 4)
    with pytest.raises(TraceError, match=r"_Branchy\.forward as one graph at .*test_ortmodule\.py:\d+ \(if y\.sum"):
        ORTModule(_Branchy())(x)
    with pytest.raises(TraceError, match=r"no ONNX translation for aten\.kthvalue\), called at .*models\.py"):
        ORTModule(KthValue())(x)
    with pytest.raises(TypeError, match="wraps a torch.nn.Module, got function"):
        ORTModule(lambda v: v)


class _Once(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(20, 4)

    def forward(self, x):
        return self.fc(x).tanh()


def test_the_graphs_are_built_once_per_signature(caplog):
    model = ORTModule(_Once())
    x, label = mlp_batches(1)[0]
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        for _ in range(3):
            torch.nn.functional.cross_entropy(model(x), label).backward()
    built = [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("ORT ")]
    assert built == ["ORT forward graph", "ORT backward graph"]


def test_the_forward_saves_the_weights_and_activations_not_views_of_them(monkeypatch):
    """A saved view (a transposed weight, a reshaped activation) would be an ONNX output of its own, written out
    on every forward; the forward saves the view's base and the backward takes the view, which costs nothing."""
    from ort_trainer.module import _backend

    partitions = []
    real = _backend._save_view_bases

    def recording(forward, backward, num_fwd_outputs):
        real(forward, backward, num_fwd_outputs)
        partitions.append((forward, backward, num_fwd_outputs))

    monkeypatch.setattr(_backend, "_save_view_bases", recording)
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    ids, label = lm_batches(1)[0]
    lm_loss(wrapped(ids), label).backward()
    lm_loss(reference(ids), label).backward()
    _assert_grads_equal(model, reference)
    ((forward, backward, num_fwd_outputs),) = partitions
    output = next(n for n in forward.graph.nodes if n.op == "output")
    saved = [v for v in output.args[0][num_fwd_outputs:] if isinstance(v, torch.fx.Node)]
    assert saved and not [v.name for v in saved if v.op == "call_function" and v.target in _backend._VIEWS]
    weight_views = [  # the head's and the layers' transposed weights: views of backward inputs now
        n for n in backward.graph.nodes
        if n.op == "call_function" and n.target in _backend._VIEWS and n.args[0].op == "placeholder"
    ]  # fmt: skip
    assert len(weight_views) >= 3


class _Masked(torch.nn.Module):
    """Its backward needs a bool mask the forward saves: an ORT output of type bool."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        y = self.linear(x)
        return torch.where(y > 0.1, y * 2.0, y * 0.5)


def test_on_cpu_the_outputs_come_from_onnx_runtime_and_keep_their_dtypes(monkeypatch):
    """The forward's saved tensors and the backward's gradients are ORT's own memory (no fresh pages per step); a
    saved bool mask, which ORT's DLPack export gives as uint8, reaches the backward as bool."""
    from ort_trainer.module import _graph

    seen = []
    real = _graph.from_ortvalue

    def recording(value):
        tensor = real(value)
        seen.append(tensor.dtype)
        return tensor

    monkeypatch.setattr(_graph, "from_ortvalue", recording)
    torch.manual_seed(0)
    model = _Masked()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    for _ in range(2):  # the second step: last step's gradients were freed back into ORT's arena
        x = torch.randn(4, 6)
        wrapped(x).square().sum().backward()
        reference(x).square().sum().backward()
        _assert_grads_equal(model, reference)
    # the mask as ORT hands it over: uint8 before onnxruntime 1.32 (then viewed as bool), bool from 1.32 on
    assert (torch.bool if DLPACK_ROUTE == "public" else torch.uint8) in seen
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_the_module_graphs_sessions_share_one_cpu_arena():
    """Each session kept an arena of its own, so the forward's scratch and the backward's were held side by side;
    ORT's environment holds one CPU arena that every module graph's session takes its memory from."""
    from ort_trainer.module import _graph

    assert _graph.session_options().get_session_config_entry("session.use_env_allocators") == "1"
    torch.manual_seed(0)
    model = _Masked()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 6)
    ORTModule(model)(x).square().sum().backward()  # sessions made with these options run and give eager's grads
    reference(x).square().sum().backward()
    _assert_grads_equal(model, reference)


class _ConstantMask(torch.nn.Module):
    """Its backward needs a tensor made of constants only, which the exporter's optimizer folds into an
    initializer that is an output of the forward graph."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * torch.ones(4, 4).tril()


def test_the_exporter_s_optimizer_says_nothing_to_the_user_s_log(caplog, monkeypatch):
    """The graph optimizer ran outside the exporter's quiet block: onnx_ir warned on every build of such a graph
    ("Skipped deduplication of initializer 'output_1' as it is a graph input or output")."""
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")
    caplog.set_level(logging.DEBUG)
    torch.manual_seed(0)
    model = _ConstantMask()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 4)
    ORTModule(model)(x).sum().backward()
    reference(x).sum().backward()
    _assert_grads_equal(model, reference)
    assert not [r for r in caplog.records if r.name.startswith("onnx_ir") and r.levelno >= logging.WARNING]


def test_max_graphs_counts_each_instance_s_own_graphs():
    """Dynamo's recompile limit is kept per code object, which every instance of a module class shares: a fresh
    ORTModule counted the graphs of earlier ones and could refuse its first call."""
    torch.manual_seed(0)
    x = torch.randn(3, 20)
    first = ORTModule(_Once(), max_graphs=1)
    first(x).sum().backward()  # its one graph
    second = ORTModule(_Once().eval(), max_graphs=1)
    with torch.no_grad():
        torch.testing.assert_close(second(x), second.module(x))  # its first graph (another signature)
    with pytest.raises(TraceError, match=r"compiled 1 graphs for _Once\.forward .* max_graphs"):
        second(x)  # its second (with gradients)
