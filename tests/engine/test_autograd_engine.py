"""The autograd engine (graphs from PyTorch's autograd, run by any onnxruntime) against PyTorch.

Gradients are PyTorch's formulas, so weights, BatchNorm statistics and counters must equal eager PyTorch
where the onnxblock engine needed graph work-arounds: a padding row, a tied head, gradient accumulation,
parameters the loss does not reach, new batch sizes. Also: the engine choice, what it refuses, and the
errors for models that cannot be traced.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.config.options import OptionsError
from ort_trainer.engine import _sources, choose_engine, onnxblock_available
from ort_trainer.graph.autograd._trace import TraceError

ce = torch.nn.functional.cross_entropy
DESC = {
    "inputs": [("ids", ["batch", 5]), ("label", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 10])],
}


class TiedBatchNormLM(torch.nn.Module):
    """Embedding with a padding row, BatchNorm, a head tied to the embedding, and a parameter nobody uses."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8, padding_idx=0)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, ids):
        return self.head(self.bn(self.emb(ids).mean(1)))


def _trainer(model, engine="autograd", config=None, **options):
    options = {"utils": {"engine": engine, "grad_norm_clip": False}, **options}
    return ORTTrainer(model, DESC, config or optim.SGDConfig(lr=0.1), loss_fn=ce, options=options)


def _batches(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(0, 10, (n, 5), generator=g)
        ids[:, -1] = 0  # the padding token is among the ids
        out.append((ids, torch.randint(0, 10, (n,), generator=g)))
    return out


def test_sgd_with_accumulation_equals_torch_padding_row_tied_head_batchnorm_and_new_batch_sizes(caplog):
    torch.manual_seed(0)
    model = TiedBatchNormLM()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, batch={"gradient_accumulation_steps": 2})
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    caplog.set_level(logging.INFO, logger="ort_trainer")
    for step, (ids, label) in enumerate(_batches([4, 4, 4, 4, 6, 6, 4, 4])):
        loss, logits = trainer.train_step(ids, label)
        expected_logits = reference(ids)
        expected = ce(expected_logits, label)
        (expected / 2).backward()
        if step % 2 == 1:
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(logits, expected_logits.detach(), rtol=1e-5, atol=1e-6)
    # the batch dim is named in model_desc: one symbolic graph serves batches 4 and 6, with no second build
    assert "new input shapes" not in caplog.text
    assert caplog.text.count("phase 'trace and export the training graph'") == 1
    state, expected_state = trainer.state_dict(pytorch_format=True), reference.state_dict()
    assert state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert int(state["bn.num_batches_tracked"]) == 8
    assert torch.equal(state["unused.weight"], expected_state["unused.weight"])  # never reached: never updated
    reference.eval()
    ids, label = _batches([3], seed=5)[0]
    eval_loss, _ = trainer.eval_step(ids, label)
    torch.testing.assert_close(eval_loss, ce(reference(ids), label).detach(), rtol=1e-6, atol=1e-6)


def test_padding_row_gets_no_gradient_without_a_tied_head():
    """torch never gives the padding row a gradient: after AdamW steps it moves by weight decay only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, padding_idx=0), torch.nn.Flatten(), torch.nn.Linear(20, 10))
    reference = copy.deepcopy(model)
    trainer = _trainer(model, config=optim.AdamConfig(lr=0.01, lambda_coef=0.01))
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.01)
    for ids, label in _batches([8, 8, 8]):
        trainer.train_step(ids, label)
        opt.zero_grad()
        ce(reference(ids), label).backward()
        opt.step()
    got = trainer.state_dict(pytorch_format=True)["0.weight"]
    assert torch.equal(got[0], reference[0].weight[0].detach())
    torch.testing.assert_close(got, reference[0].weight.detach(), rtol=1e-5, atol=1e-6)


def test_onnxblock_or_autograd_by_default_and_refusals(monkeypatch):
    assert choose_engine("auto") == ("onnxblock" if onnxblock_available() else "autograd")
    with pytest.raises(OptionsError, match=r"utils\.engine: must be 'auto', 'onnxblock' or 'autograd', got 'ort'"):
        _trainer(TiedBatchNormLM(), engine="ort")
    monkeypatch.setattr(_sources, "onnxblock_available", lambda: False)
    assert choose_engine("auto") == "autograd"
    with pytest.raises(
        ValueError, match=r"engine='onnxblock' needs onnxruntime-training.*pip uninstall -y onnxruntime"
    ):
        _trainer(TiedBatchNormLM(), engine="onnxblock")


def test_what_the_autograd_engine_cannot_do_names_the_engine_that_can():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"autograd engine does not support _internal_use.*'engine': 'onnxblock'"):
        ORTTrainer(
            model,
            {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]},
            optim.SGDConfig(lr=0.1),
            loss_fn=ce,
            options={"utils": {"engine": "autograd"}, "_internal_use": {"extra_postprocess": lambda m: m}},
        )
    nodes = [  # an ONNX model trains on this engine, but not one with an op it has no route for
        onnx.helper.make_node("Mul", ["x", "w"], ["h"]),
        onnx.helper.make_node("TopK", ["h", "k"], ["top", "at"]),
        onnx.helper.make_node("ReduceSum", ["top"], ["loss"], keepdims=0),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
        [onnx.numpy_helper.from_array(torch.ones(3).numpy(), "w"), onnx.numpy_helper.from_array(np.array([2]), "k")],
    )
    with pytest.raises(ValueError, match=r"ONNX ops without a torch route: TopK .*'engine': 'onnxblock'"):
        ORTTrainer(
            onnx.helper.make_model(graph),
            {"inputs": [("x", [3])], "outputs": [("loss", [], True)]},
            optim.SGDConfig(lr=0.1),
            options={"utils": {"engine": "autograd"}},
        )


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 10)

    def forward(self, ids):
        h = self.fc(ids.float())
        if h.sum() > 0:  # Python control flow on a tensor value
            h = h * 2
        return h


def test_data_dependent_control_flow_names_the_line_and_the_way_out():
    trainer = _trainer(DataDependent())
    ids, label = _batches([4])[0]
    with pytest.raises(TraceError, match=r"test_autograd_engine\.py:\d+ \(if h\.sum\(\) > 0:.*torch\.where"):
        trainer.train_step(ids, label)


def test_dropout_masks_repeat_for_the_same_seed_and_differ_between_steps():
    def losses(seed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(10, 8), torch.nn.Dropout(0.5), torch.nn.Flatten(), torch.nn.Linear(40, 10)
        )
        torch.manual_seed(seed)
        trainer = _trainer(model)
        ids, label = _batches([8])[0]
        return [float(trainer.train_step(ids, label)[0]) for _ in range(3)]

    first, again, other = losses(1), losses(1), losses(2)
    assert first == again
    assert first != other


def test_bad_inputs_are_named_with_pytorchs_own_words_before_and_after_the_build():
    torch.manual_seed(0)
    trainer = _trainer(TiedBatchNormLM())
    ids, label = _batches([4])[0]
    with pytest.raises(
        ValueError, match=r"input 'label' holds class indices \[12\] out of range: the model predicts 10 classes"
    ):
        trainer.train_step(ids, torch.full_like(label, 12))  # the first step: traced, exported, then run
    trainer.train_step(ids, label)
    with pytest.raises(
        ValueError, match=r"input 'label' holds class indices \[10\] out of range: the model predicts 10 classes"
    ):
        trainer.train_step(ids, torch.full_like(label, 10))  # a later step: ONNX Runtime fails, PyTorch explains
    state = trainer.state_dict(pytorch_format=True)
    assert all(torch.isfinite(v.float()).all() for v in state.values())


@pytest.mark.parametrize(
    "options, named",
    [
        ({"_internal_use": {"onnx_opset_version": 14}}, r"_internal_use\.onnx_opset_version=14"),
        (
            {"debug": {"graph_save_paths": {"model_after_graph_transforms_path": "forward.onnx"}}},
            r"debug\.graph_save_paths\.model_after_graph_transforms_path",
        ),
    ],
    ids=["opset", "forward-graph-dump"],
)
def test_an_option_the_autograd_engine_would_ignore_is_refused_at_construction(options, named, tmp_path):
    """Its exporter chooses the opset and it has no onnxblock forward graph to dump: the option is refused by name
    (GraphSource.check_supported), never silently dropped."""
    if "debug" in options:
        options["debug"]["graph_save_paths"]["model_after_graph_transforms_path"] = str(tmp_path / "forward.onnx")
    with pytest.raises(ValueError, match=rf"autograd engine does not support {named}.*'engine': 'onnxblock'"):
        ORTTrainer(
            torch.nn.Linear(4, 2),
            {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]},
            optim.SGDConfig(lr=0.1),
            loss_fn=ce,
            options={"utils": {"engine": "autograd"}, **options},
        )
    assert not (tmp_path / "forward.onnx").exists()


def test_the_default_opset_the_autograd_engine_accepts_is_the_options_default():
    from ort_trainer.config.options import ORTTrainerOptions
    from ort_trainer.engine.autograd import _build

    assert ORTTrainerOptions({})._internal_use.onnx_opset_version == _build._DEFAULT_OPSET
