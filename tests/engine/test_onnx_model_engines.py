"""An ``onnx.ModelProto`` with its loss inside trains on the autograd engine (the default, stock onnxruntime) as
PyTorch trains the model it was exported from, and as the onnxblock engine trains it: its float initializers are
the parameters, under their ONNX names, in the state dict and in checkpoints. Ops without a torch route are refused
at construction, every one by op type and node name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import ORTTrainer, optim
from tests.models import MLP, MLP_DESC, mlp_batches
from tests.onnx_models import assert_state_matches, ce, export_with_loss, onnx_case, torch_sgd_steps

AUTOGRAD = {"utils": {"engine": "autograd"}}


def _float_initializers(model: onnx.ModelProto) -> list[str]:
    return [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT]


@pytest.mark.parametrize("case", ["mlp", "cnn", "flattening"])
def test_an_onnx_model_trains_on_the_autograd_engine_as_pytorch_trains_its_source(case):
    """Gemm/SoftmaxCrossEntropyLoss; Conv and training-mode BatchNorm (running statistics written back, frozen);
    an Embedding's Gather, LayerNormalization, Erf, and a Reshape whose shape is computed from the input's."""
    exported, reference, desc, batches = onnx_case(case)
    trainer = ORTTrainer(exported, desc, optim.SGDConfig(lr=0.1), options=AUTOGRAD)
    assert trainer.engine == "autograd"
    assert set(trainer.state_dict()["model"]["full_precision"]) == set(_float_initializers(exported))
    losses = [trainer.train_step(*batch) for batch in batches]
    torch.testing.assert_close(
        torch.stack(losses), torch.stack(torch_sgd_steps(reference, batches)), atol=1e-5, rtol=1e-5
    )
    assert_state_matches(trainer, reference)
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.eval_step(*batches[0]), ce(reference(batches[0][0]), batches[0][1]), atol=1e-5, rtol=1e-5
        )


def test_frozen_weights_of_an_onnx_model_stay_and_the_rest_train_as_in_pytorch():
    exported, reference, desc, batches = onnx_case("mlp", steps=3)
    options = {"utils": {"engine": "autograd", "frozen_weights": ["m.fc1.weight"]}}
    trainer = ORTTrainer(exported, desc, optim.SGDConfig(lr=0.1), options=options)
    reference.fc1.weight.requires_grad_(False)
    losses = [trainer.train_step(*batch) for batch in batches]
    torch.testing.assert_close(
        torch.stack(losses), torch.stack(torch_sgd_steps(reference, batches)), atol=1e-5, rtol=1e-5
    )
    assert_state_matches(trainer, reference)
    initial = numpy_helper.to_array(next(i for i in exported.graph.initializer if i.name == "m.fc1.weight"))
    assert np.array_equal(trainer.state_dict()["model"]["full_precision"]["m.fc1.weight"].numpy(), initial)


def test_an_onnx_model_checkpoint_round_trips_and_training_continues_identically(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(4)
    exported = export_with_loss(model, batches[0])
    before = exported.SerializeToString()
    first = ORTTrainer(exported, MLP_DESC, optim.AdamConfig(lr=0.01), options=AUTOGRAD)
    for batch in batches[:2]:
        first.train_step(*batch)
    first.save_checkpoint(tmp_path / "onnx.ortcp")
    second = ORTTrainer(exported, MLP_DESC, optim.AdamConfig(lr=0.01), options=AUTOGRAD)
    second.load_checkpoint(tmp_path / "onnx.ortcp")
    saved, loaded = first.state_dict(), second.state_dict()
    assert set(loaded["model"]["full_precision"]) == set(_float_initializers(exported))
    for name, value in saved["model"]["full_precision"].items():
        assert torch.equal(loaded["model"]["full_precision"][name], value), name
    for batch in batches[2:]:
        assert torch.equal(first.train_step(*batch), second.train_step(*batch))
    for name, value in first.state_dict()["model"]["full_precision"].items():
        assert torch.equal(second.state_dict()["model"]["full_precision"][name], value), name
    assert exported.SerializeToString() == before  # the user's model is left as it was


def _graph(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )


def test_ops_without_a_torch_route_are_refused_at_construction_every_one_by_name():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "b",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("TopK", ["h", "k"], ["top", "where"], name="top_a"),
        helper.make_node("FusedMatMul", ["top", "w2"], ["f"], name="fused", domain="com.microsoft"),
        helper.make_node("TopK", ["f", "k"], ["top2", "where2"], name="top_b"),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["s", "zero"], ["positive"], name="cmp"),
        helper.make_node("If", ["positive"], ["chosen"], name="branching", then_branch=branch, else_branch=branch),
        helper.make_node("ReduceMean", ["top2"], ["loss"], keepdims=0, name="mean"),
    ]  # fmt: skip
    inits = [
        numpy_helper.from_array(np.ones((4, 4), np.float32), "w"),
        numpy_helper.from_array(np.ones((2, 4), np.float32), "w2"),
        numpy_helper.from_array(np.array([2], np.int64), "k"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    desc = {"inputs": [("x", ["b", 4])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError) as raised:
        ORTTrainer(_graph(nodes, [x], [loss], inits), desc, optim.SGDConfig(lr=0.1), options=AUTOGRAD)
    assert str(raised.value) == (
        "the autograd engine cannot train this ONNX model: ONNX ops without a torch route: If (node 'branching'); "
        "TopK (nodes 'top_a', 'top_b'); com.microsoft.FusedMatMul (node 'fused'); use "
        "options={'utils': {'engine': 'onnxblock'}} (needs onnxruntime-training: docs/engines.md)"
    )


def test_a_graph_input_that_no_model_desc_input_feeds_is_refused_at_construction():
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "bias"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("x", "bias")]
    model = _graph(nodes, inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                   [numpy_helper.from_array(np.ones(3, np.float32), "w")])  # fmt: skip
    desc = {"inputs": [("x", [3])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match=r"graph inputs \['bias'\] are not model_desc inputs"):
        ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), options=AUTOGRAD)
