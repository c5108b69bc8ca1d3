"""What the autograd engine's sessions hold: no folded blocks of zeros, no zeros scattered and then added.

PyTorch's decompositions write an embedding's gradient as a scatter into a [vocab, d] tensor of zeros, and
the loss's as a scatter into zeros the size of the logits. ONNX Runtime's constant folding kept those zeros
as initializers for the session's life (200 MiB at GPT-2 124M), and a tied head added the zeros-based
scatter to its own gradient (two [vocab, d] blocks alive where the activations peak). The gradients must
stay PyTorch's.
"""

from __future__ import annotations

import copy

import numpy
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from ort_trainer import ORTModule, ORTTrainer, optim
from ort_trainer.graph.autograd import collapse_layout_chains, fold_zero_scatter_adds

VOCAB, WIDTH, BATCH = 3000, 96, 16  # [vocab, d] and [tokens, vocab] above the exporter's folding limit
DESC = {"inputs": [("ids", ["batch", 7]), ("label", ["batch", 7])], "outputs": [("loss", [], True)]}


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def lm_loss(logits, label):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), label.reshape(-1))


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (BATCH, 7), generator=g), torch.randint(0, VOCAB, (BATCH, 7), generator=g))
        for _ in range(n)
    ]


def _assert_trains_as_pytorch(trainer, reference, loss_fn, batches, lr=0.5):
    """The trainer's SGD steps (its lr must be ``lr``) against torch's SGD on ``reference``: losses, then weights."""
    opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for ids, label in batches:
        got = trainer.train_step(ids, label)
        opt.zero_grad()
        expected = loss_fn(reference(ids), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(got, expected.detach(), rtol=1e-6, atol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_a_tied_embedding_scatters_into_its_heads_gradient_and_trains_as_pytorch(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    gradient_graph = tmp_path / "gradient.onnx"
    trainer = ORTTrainer(
        model,
        DESC,
        optim.SGDConfig(lr=0.5),
        loss_fn=lm_loss,
        options={
            "utils": {"engine": "autograd", "grad_norm_clip": False, "graph_cache": False},
            "debug": {"graph_save_paths": {"model_with_gradient_graph_path": str(gradient_graph)}},
        },
    )
    batches = _batches(3)
    batches[0][0][:, :3] = 5  # one row of the embedding gets several terms in one step
    _assert_trains_as_pytorch(trainer, reference, lm_loss, batches)

    graph = onnx.load(str(gradient_graph)).graph
    producers = {out: node for node in graph.node for out in node.output}
    scatters = [n for n in graph.node if n.op_type == "ScatterND"]
    (into_head,) = [n for n in scatters if n.output[0].endswith("emb.weight_grad")]
    assert producers[into_head.input[0]].op_type in ("MatMul", "Gemm", "Transpose")  # the head's gradient
    for node in graph.node:  # no zeros-based scatter is added to anything any more
        if node.op_type == "Add":
            assert all(producers.get(i) is None or producers[i].op_type != "ScatterND" for i in node.input), node


def test_the_training_session_holds_no_folded_tensor_of_zeros(tmp_path):
    optimized = tmp_path / "optimized.onnx"
    trainer = ORTTrainer(
        TiedLM(),
        DESC,
        optim.SGDConfig(lr=0.1),
        loss_fn=lm_loss,
        options={
            "utils": {"engine": "autograd", "graph_cache": False},
            "debug": {"graph_save_paths": {"model_with_training_graph_after_optimization_path": str(optimized)}},
        },
    )
    trainer.train_step(*_batches(1)[0])
    graph = onnx.load(str(optimized)).graph
    sizes = {init.name: numpy_helper.to_array(init).nbytes for init in graph.initializer}
    exporter_limit = 4 * 512 * 512  # onnxscript folds constants up to 512 * 512 elements itself
    assert min(BATCH * 7 * VOCAB, VOCAB * WIDTH) * 4 > exporter_limit
    assert max(sizes.values()) <= exporter_limit, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_fold_zero_scatter_adds_leaves_a_scatter_into_another_shape_alone():
    """The rewrite needs the added tensor to have the scatter's shape and dtype: a broadcasting Add stays."""
    zero = numpy_helper.from_array(torch.zeros(()).numpy(), "zero")
    shape = numpy_helper.from_array(torch.tensor([4, 3]).numpy(), "shape")
    nodes = [
        onnx.helper.make_node("Expand", ["zero", "shape"], ["zeros"]),
        onnx.helper.make_node("ScatterND", ["zeros", "idx", "upd"], ["scattered"], reduction="add"),
        onnx.helper.make_node("Add", ["bias", "scattered"], ["out"]),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [
            onnx.helper.make_tensor_value_info("idx", onnx.TensorProto.INT64, [2, 1]),
            onnx.helper.make_tensor_value_info("upd", onnx.TensorProto.FLOAT, [2, 3]),
            onnx.helper.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, [3]),
        ],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [4, 3])],
        [zero, shape],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    assert fold_zero_scatter_adds(model) == 0
    model.graph.input[2].CopyFrom(onnx.helper.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, [4, 3]))
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert fold_zero_scatter_adds(model) == 1
    assert [n.op_type for n in model.graph.node] == ["ScatterND"]
    feeds = {
        "idx": torch.tensor([[1], [1]]).numpy(),
        "upd": torch.randn(2, 3).numpy(),
        "bias": torch.randn(4, 3).numpy(),
    }
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]  # noqa: E731
    torch.testing.assert_close(torch.from_numpy(run(model)), torch.from_numpy(run(before)), rtol=1e-6, atol=1e-6)


def test_ortmodule_sessions_leave_constant_folding_out(monkeypatch):
    made = []
    real = ort.InferenceSession

    def recording(*args, **kwargs):
        made.append(kwargs.get("disabled_optimizers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    torch.manual_seed(0)
    model = ORTModule(TiedLM())
    ids, label = _batches(1)[0]
    lm_loss(model(ids), label).backward()
    assert made and all(kinds == ["ConstantFolding"] for kinds in made), made


def _chain_graph(output_shape):
    """x -> Transpose -> Transpose back -> Reshape(-1) -> Reshape(0, 0) -> identity Transpose -> graph output."""
    nodes = [
        onnx.helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 0, 2]),
        onnx.helper.make_node("Transpose", ["t1"], ["t2"], perm=[2, 1, 0]),
        onnx.helper.make_node("Transpose", ["t2"], ["t3"], perm=[1, 2, 0]),  # t3 = x transposed (1, 0, 2) twice: x
        onnx.helper.make_node("Relu", ["t3"], ["r"]),
        onnx.helper.make_node("Reshape", ["r", "flat"], ["v1"]),
        onnx.helper.make_node("Reshape", ["v1", "same"], ["v2"]),
        onnx.helper.make_node("Transpose", ["v2"], ["out"], perm=[0, 1]),
        onnx.helper.make_node("Neg", ["t1"], ["side"]),  # the first transpose has another reader: it stays
    ]
    inits = [
        numpy_helper.from_array(numpy.array([-1, 8], "int64"), "flat"),
        numpy_helper.from_array(numpy.array(output_shape, "int64"), "same"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])],
        [
            onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [3, 8]),
            onnx.helper.make_tensor_value_info("side", onnx.TensorProto.FLOAT, [3, 2, 4]),
        ],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)


def test_collapse_layout_chains_leaves_the_layouts_that_change_something():
    model = _chain_graph([0, -1])  # v2 = Reshape(v1, [0, -1]) keeps v1's [3, 8]: a no-op
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert collapse_layout_chains(model) > 0
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Transpose") == 1  # t1 (read by Neg); t2/t3 cancel
    assert ops.count("Identity") == 1  # the identity transpose before `out`: a graph output keeps its name
    assert ops.count("Reshape") == 1  # Reshape(x', [-1, 8]) straight to the graph output
    feeds = {"x": numpy.random.default_rng(0).standard_normal((2, 3, 4)).astype("float32")}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    for got, expected in zip(run(model), run(before), strict=True):
        numpy.testing.assert_array_equal(got, expected)


def test_the_exported_training_graph_has_no_transpose_or_reshape_chains(tmp_path):
    from tests.hf_tiny import GPT2, token_loss

    torch.manual_seed(0)
    path = tmp_path / "gradient.onnx"
    desc = {
        "inputs": [("input_ids", ["batch", 8]), ("attention_mask", ["batch", 8]), ("label", ["batch", 8])],
        "outputs": [("loss", [], True)],
    }
    trainer = ORTTrainer(
        GPT2(layers=2),
        desc,
        optim.SGDConfig(lr=0.1),
        loss_fn=token_loss,
        options={
            "utils": {"engine": "autograd", "graph_cache": False},
            "debug": {"graph_save_paths": {"model_with_gradient_graph_path": str(path)}},
        },
    )
    ids = torch.randint(0, 50, (2, 8))
    trainer.train_step(ids, torch.ones_like(ids), ids)
    graph = onnx.load(str(path)).graph
    producers = {out: node for node in graph.node for out in node.output}
    chains = [
        n.name
        for n in graph.node
        if n.op_type in ("Transpose", "Reshape") and getattr(producers.get(n.input[0]), "op_type", None) == n.op_type
    ]
    assert not chains
    assert sum(n.op_type == "Transpose" for n in graph.node) > 0  # the layouts that matter are still there


def _exported(model, loss, batch):
    from ort_trainer.config.model_desc import validate_model_desc
    from ort_trainer.graph.autograd import graph_to_onnx, trace_graph

    desc = validate_model_desc(DESC, require_loss=True)
    params = {name: p.detach() for name, p in model.named_parameters()}
    traced = trace_graph(model, loss, desc, params, {}, list(batch), training=True)
    return graph_to_onnx(traced), traced


def _run_graph(model, traced, seed=0):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    feeds = {n: v.detach().numpy() for n, v in zip(traced.input_names, traced.sample_args, strict=True) if n in wanted}
    return session.run(None, feeds)


def test_the_loss_gradient_without_its_one_hot_is_bit_equal_with_ignored_labels(monkeypatch):
    from ort_trainer.graph.autograd import _to_onnx

    torch.manual_seed(0)
    model = TiedLM()
    ids, label = _batches(1)[0]
    label[0, :4] = -100  # ignored positions: their rows get no gradient
    batch = (ids, label)
    rewritten, traced = _exported(model, lm_loss, batch)
    scatters = [n for n in rewritten.graph.node if n.op_type == "ScatterElements"]
    assert [next(a.s for a in n.attribute if a.name == "reduction") for n in scatters] == [b"add"]
    monkeypatch.setattr(_to_onnx, "fold_one_hot_loss_gradients", lambda model: 0)
    plain, _ = _exported(model, lm_loss, batch)
    assert any(n.op_type == "ScatterElements" for n in plain.graph.node)
    assert len(rewritten.graph.node) < len(plain.graph.node)
    for got, expected in zip(_run_graph(rewritten, traced), _run_graph(plain, traced), strict=True):
        numpy.testing.assert_array_equal(got, expected)


def test_a_smoothed_or_summed_loss_trains_as_pytorch():
    """Label smoothing adds a term to every class (not the one-hot form: the rewrite must leave it), a sum
    reduction scales each row by the output's gradient; both train as PyTorch, with ignored labels."""
    for loss in (
        lambda logits, label: torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), label.reshape(-1), label_smoothing=0.1
        ),
        lambda logits, label: (
            torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), label.reshape(-1), reduction="sum") / 100
        ),
    ):
        torch.manual_seed(0)
        model = TiedLM()
        reference = copy.deepcopy(model)
        trainer = ORTTrainer(
            model, DESC, optim.SGDConfig(lr=0.5), loss_fn=loss,
            options={"utils": {"engine": "autograd", "grad_norm_clip": False, "graph_cache": False}},
        )  # fmt: skip
        batches = _batches(2, seed=3)
        for _, label in batches:
            label[0, :2] = -100
        _assert_trains_as_pytorch(trainer, reference, loss, batches)


def test_a_symbolic_training_graph_writes_the_loss_gradient_without_its_one_hot(tmp_path):
    """With batch and sequence dims named (one graph for every shape), the [tokens, vocab] sizes are symbolic: the
    one-hot rewrite must still apply (it did only on static shapes: three more [tokens, vocab] tensors at the top
    of the backward, 290 MiB at GPT-2 124M, batch 4 x 128), and train as PyTorch at every shape."""
    desc = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    optimized = tmp_path / "optimized.onnx"
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(
        model, desc, optim.SGDConfig(lr=0.5), loss_fn=lm_loss,
        options={
            "utils": {"engine": "autograd", "grad_norm_clip": False, "graph_cache": False},
            "debug": {"graph_save_paths": {"model_with_training_graph_after_optimization_path": str(optimized)}},
        },
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, VOCAB, (rows, length), generator=g), torch.randint(0, VOCAB, (rows, length), generator=g))
        for rows, length in ((16, 7), (12, 5), (3, 9))
    ]
    batches[1][1][0, :3] = -100
    _assert_trains_as_pytorch(trainer, reference, lm_loss, batches)
    graph = onnx.load(str(optimized)).graph
    ids = next(i for i in graph.input if i.name == "ids")
    assert all(d.HasField("dim_param") for d in ids.type.tensor_type.shape.dim)  # one graph for every shape
    reductions = [
        next(a.s for a in n.attribute if a.name == "reduction") for n in graph.node if n.op_type == "ScatterElements"
    ]
    assert reductions == [b"add"], reductions
