"""`split_summed_accumulations`: a weight's gradient terms are accumulated one by one (memory), same values."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph.onnxblock.rewrites import split_summed_accumulations
from tests.models import TinyLM, lm_batches, lm_loss

LM_DESC = {"inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}


def _accumulate_sum(terms: int, flag: bool) -> onnx.ModelProto:
    """``InPlaceAccumulatorV2(buf, Sum(t0..tn), overwrite?) -> (updated, buf_out)``."""
    names = [f"t{i}" for i in range(terms)]
    inputs = ["buf", "summed", "overwrite"] if flag else ["buf", "summed"]
    graph = helper.make_graph(
        [
            helper.make_node("Sum", names, ["summed"]),
            helper.make_node("InPlaceAccumulatorV2", inputs, ["updated", "buf_out"], domain="com.microsoft"),
        ],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 4]) for n in ["buf", *names]]
        + ([helper.make_tensor_value_info("overwrite", TensorProto.BOOL, [1])] if flag else []),
        [
            helper.make_tensor_value_info("updated", TensorProto.BOOL, [1]),
            helper.make_tensor_value_info("buf_out", TensorProto.FLOAT, [3, 4]),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["buf_out"], {k: v.copy() for k, v in feeds.items()})[0]


@pytest.mark.parametrize("terms", [2, 3])
@pytest.mark.parametrize("overwrite", [True, False, None])
def test_the_chain_gives_the_sum_and_honours_the_overwrite_flag(terms, overwrite):
    rng = np.random.default_rng(terms)
    feeds = {f"t{i}": rng.standard_normal((3, 4)).astype(np.float32) for i in range(terms)}
    feeds["buf"] = rng.standard_normal((3, 4)).astype(np.float32)
    if overwrite is not None:
        feeds["overwrite"] = np.array([overwrite])
    model = _accumulate_sum(terms, overwrite is not None)
    expected = _run(model, feeds)
    assert split_summed_accumulations(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "Sum" not in ops and ops.count("InPlaceAccumulatorV2") == terms and ops.count("Not") == terms - 1
    onnx.checker.check_model(model)
    got = _run(model, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    start = np.zeros_like(feeds["buf"]) if overwrite else feeds["buf"]
    np.testing.assert_allclose(got, start + sum(feeds[f"t{i}"] for i in range(terms)), rtol=1e-6, atol=1e-6)


def test_a_sum_with_another_reader_is_left_alone():
    model = _accumulate_sum(2, flag=True)
    model.graph.output.append(helper.make_tensor_value_info("summed", TensorProto.FLOAT, [3, 4]))
    assert split_summed_accumulations(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Sum", "InPlaceAccumulatorV2"]


def test_tied_weights_train_like_torch_with_accumulation_and_no_sum_reaches_an_accumulator(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(vocab=40)
    model.head.weight = model.embed.weight  # two gradient terms: the head's and the embedding's
    with torch.no_grad():
        model.embed.weight.mul_(0.1)  # N(0, 1) embeddings as the head give huge logits: keep the logits modest
    reference = copy.deepcopy(model)
    path = tmp_path / "train.onnx"
    options = {
        "batch": {"gradient_accumulation_steps": 2},
        "debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}},
    }
    trainer = ORTTrainer(model, LM_DESC, optim.SGDConfig(lr=0.1), loss_fn=lm_loss, options=options)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)  # linear in the gradient: a wrong sum shows
    for index, (tokens, label) in enumerate(lm_batches(6, vocab=40)):
        got = trainer.train_step(tokens, label)
        expected = lm_loss(reference(tokens), label)
        (expected / 2).backward()
        if index % 2 == 1:
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)[name], value, rtol=1e-4, atol=1e-5)
    graph = onnx.load(str(path)).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    accumulated = [n.input[1] for n in graph.node if n.op_type == "InPlaceAccumulatorV2"]
    assert accumulated and all(producer.get(name) != "Sum" for name in accumulated)
    assert sum("embed.weight" in n.input[0] for n in graph.node if n.op_type == "InPlaceAccumulatorV2") == 2
