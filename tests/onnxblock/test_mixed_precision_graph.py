"""Mixed-precision forward graph: the fp16 support probe, the conversion, and its training graph on the CPU EP.

Two support maps are used. ``cpu``: what the CPU EP really supports (probed). ``gpu-like``: every op
of the model marked supported, as a CUDA EP would report; ORT's CPU EP then runs the fp16 nodes
through its own inserted casts, which exercises the converted graph end to end. (That CPU emulation
is not bit-faithful fp16: ORT drops Cast(fp32->fp16)->Cast(fp16->fp32) pairs around kernels it lacks
in fp16, so some roundings vanish; data-movement kernels it has in fp16 keep theirs.)

Tolerances, from fp16's unit roundoff u = 2**-11 ~ 4.9e-4: the loss is a mean of log-softmaxes of
logits each rounded once or a few times: |dloss|/loss <= ~10u -> rtol 5e-3. Gradients pass through
~20 rounded ops and ReLU/attention decisions can flip for values within u of a boundary (seen: one
row of a ReLU layer's weight gradient off by 6% of its max, identical in torch's own fp16), so they
are compared per tensor in relative L2 norm, <= 2e-2 (~40u). Measured: loss <= 2e-5, grads <= 9e-4.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer.config.model_desc import validate_model_desc
from ort_trainer.engine.onnxblock._graphs import build_training_graphs
from ort_trainer.graph import _fp16_support
from ort_trainer.graph._fp16_support import fp16_support_reasons, model_op_types, provider_fp16_support
from ort_trainer.graph._weightless import checkable
from ort_trainer.graph.onnxblock._export import export_torch_model
from ort_trainer.graph.onnxblock._mixed_precision import (
    LOSS_SCALE_INPUT,
    convert_to_mixed_precision,
    strip_loss_scaling,
)
from ort_trainer.graph.onnxblock._passes import add_optional_outputs
from tests.models import LM_DESC, MLP, MLP_DESC, TinyLM, lm_batches, lm_loss, mlp_batches

CPU = ["CPUExecutionProvider"]
SCALE = 1024.0  # a power of two: scaling and unscaling are exact in fp32
LOSS_RTOL, GRAD_RTOL = 5e-3, 2e-2


class _Case:
    """An exported forward graph (as ORTTrainer builds it), its inputs, and fp32 loss/gradients."""

    def __init__(self, model, loss_fn, desc, batch):
        torch.manual_seed(0)
        desc = validate_model_desc(desc, require_loss=True)
        exported = export_torch_model(copy.deepcopy(model), loss_fn, desc, batch, 17)
        self.forward = exported.model
        add_optional_outputs(self.forward)
        self.params = [n for n in dict.fromkeys(exported.fqn_to_onnx.values()) if n not in exported.buffers]
        self.state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        self.feeds = {name: t.numpy() for name, t in zip(desc.input_names, batch, strict=True)}
        self.loss = desc.output_names[0]
        train, _ = build_training_graphs(copy.deepcopy(self.forward), self.params, [], [self.loss])
        self.ref_loss, self.ref_grads = self.run(train, {})

    def support(self, kind: str) -> dict:
        ops = model_op_types(self.forward)
        if kind == "cpu":
            return provider_fp16_support(CPU, ops)
        return {(domain, op): True for domain, op, _ in ops}

    def convert(self, support):
        return convert_to_mixed_precision(
            self.forward, trainable=self.params, frozen=[], loss_output=self.loss, support=support
        )

    def run(self, train: onnx.ModelProto, extra: dict):
        """One training step: returns the loss and the gradients accumulated in fp32 buffers."""
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 2
        session = ort.InferenceSession(train.SerializeToString(), options, CPU)
        buffers = {p: np.zeros_like(self.state[p]) for p in self.params}  # InPlaceAccumulatorV2 writes here
        feeds = {**self.feeds, **extra, **{p: self.state[p] for p in self.params}, "lazy_reset_grad": np.array([True])}
        feeds.update({f"{p}_grad.accumulation.buffer": b for p, b in buffers.items()})
        names = [o.name for o in session.get_outputs()]  # every output, or the accumulators do not run
        out = dict(zip(names, session.run(names, feeds), strict=True))
        return float(out[self.loss]), buffers


@pytest.fixture(scope="module")
def cases():
    torch.manual_seed(0)
    mlp = _Case(MLP(), torch.nn.functional.cross_entropy, MLP_DESC, mlp_batches(1)[0])
    torch.manual_seed(0)
    lm = _Case(TinyLM(), lm_loss, LM_DESC, lm_batches(1)[0])
    return {"mlp": mlp, "lm": lm}


def _train_graph(case, mixed):
    train, _ = build_training_graphs(mixed.model, case.params, [], [mixed.backprop_output, case.loss])
    return train


# ------------------------------------------------------------------------------------------ (1) probe
def test_cpu_probe_reports_what_onnxruntime_1_19_cpu_really_has():
    # Observed facts of onnxruntime-training 1.19.2's CPU EP (x86): float16 kernels exist only for
    # data movement and a few elementwise ops; none for the arithmetic a model spends its time in.
    movement = ["Transpose", "Reshape", "Gather", "Concat", "Slice", "Cast"]
    compute = ["MatMul", "Gemm", "Add", "Relu", "LayerNormalization", "Softmax", "SoftmaxCrossEntropyLoss"]
    support = provider_fp16_support(CPU, [("", op, 17) for op in movement + compute])
    assert {op for (_, op), ok in support.items() if ok} == set(movement)
    reasons = fp16_support_reasons(CPU, [("", "Add", 17)])
    # Why a probe must look past session creation: ORT accepts a float16 Add on CPU, wrapping it in casts.
    assert "inserted float32 casts" in reasons[("", "Add")]
    add = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["a", "b"], ["c"])],
            "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [2]) for n in "ab"],
            [helper.make_tensor_value_info("c", TensorProto.FLOAT16, [2])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    ort.InferenceSession(add.SerializeToString(), providers=CPU)  # no error: creation alone would lie


def test_probe_results_are_cached_per_provider_list(monkeypatch):
    provider_fp16_support(CPU, [("", "Transpose", 17)])
    monkeypatch.setattr(_fp16_support, "_probe", lambda *a: pytest.fail("probed twice"))
    assert provider_fp16_support(CPU, [("ai.onnx", "Transpose", 17)]) == {("", "Transpose"): True}


def test_kernel_registry_is_preferred_when_the_build_exposes_it(monkeypatch):
    class Kernel:
        def __init__(self, op, provider, versions, constraints):
            self.op_name, self.domain, self.provider = op, "", provider
            self.version_range, self.type_constraints = versions, constraints

    registry = [
        Kernel("MatMul", "FakeEP", (13, 2**31 - 1), {"T": ["tensor(float)", "tensor(float16)"]}),
        Kernel("Relu", "FakeEP", (14, 2**31 - 1), {"T": ["tensor(float)"]}),
        Kernel("Dropout", "FakeEP", (13, 2**31 - 1), {"T": ["tensor(float16)"], "T1": ["tensor(float)"]}),
        Kernel("Gemm", "OtherEP", (13, 2**31 - 1), {"T": ["tensor(float16)"]}),
    ]
    monkeypatch.setattr(_fp16_support, "_kernel_registry", lambda: registry)
    ops = [("", op, 17) for op in ("MatMul", "Relu", "Dropout", "Gemm")]
    support = provider_fp16_support([("FakeEP", {})], ops)
    # Dropout: only its data type must be fp16-capable; its ratio (T1) stays float32 by design.
    assert support == {("", "MatMul"): True, ("", "Relu"): False, ("", "Dropout"): True, ("", "Gemm"): False}


# --------------------------------------------------------------------------------- (2) + (3) numerics
@pytest.mark.parametrize("name", ["mlp", "lm"])
@pytest.mark.parametrize("kind", ["cpu", "gpu-like"])
def test_loss_and_unscaled_gradients_match_fp32(cases, name, kind):
    case = cases[name]
    mixed = case.convert(case.support(kind))
    loss, grads = case.run(_train_graph(case, mixed), {mixed.loss_scale_input: np.array(SCALE, np.float32)})
    if kind == "cpu":
        # No compute op has a CPU fp16 kernel: the graph is the fp32 graph plus loss scaling, exactly.
        assert mixed.fp16_nodes == [] and mixed.inserted_casts == 0
        assert loss == case.ref_loss
        for p in case.params:
            np.testing.assert_array_equal(grads[p] / SCALE, case.ref_grads[p])
        return
    assert {"Gemm"} <= set(mixed.fp16_ops)
    if name == "lm":
        assert {"MatMul", "LayerNormalization", "Softmax", "Add", "Gather"} <= set(mixed.fp16_ops)
        assert loss != case.ref_loss  # fp16 rounding is really there (data-movement kernels keep it)
    assert loss == pytest.approx(case.ref_loss, rel=LOSS_RTOL)
    for p in case.params:
        ref = case.ref_grads[p]
        assert np.linalg.norm(grads[p] / SCALE - ref) <= GRAD_RTOL * np.linalg.norm(ref), p


def test_fp16_overflow_reaches_the_fp32_gradient_buffers_as_non_finite(cases):
    """What the trainer's all-finite check sees: a too large scale overflows an fp16 gradient."""
    case = cases["lm"]
    for kind, finite in (("gpu-like", False), ("cpu", True)):
        mixed = case.convert(case.support(kind))
        _, grads = case.run(_train_graph(case, mixed), {mixed.loss_scale_input: np.array(2.0**24, np.float32)})
        assert all(np.isfinite(g).all() for g in grads.values()) is finite, kind


# ----------------------------------------------------------------------------------- (4) graph I/O
def _io(graph):
    return {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}


@pytest.mark.parametrize("name", ["mlp", "lm"])
def test_graph_inputs_and_outputs_keep_their_declared_types(cases, name):
    case = cases[name]
    mixed = case.convert(case.support("gpu-like"))
    onnx.checker.check_model(checkable(mixed.model), full_check=True)
    before, after = _io(case.forward.graph), _io(mixed.model.graph)
    assert {k: v for k, v in after.items() if k not in (mixed.loss_scale_input, mixed.backprop_output)} == before
    assert mixed.loss_scale_input == LOSS_SCALE_INPUT
    assert after[LOSS_SCALE_INPUT] == after[mixed.backprop_output] == TensorProto.FLOAT
    assert mixed.backprop_output == f"{case.loss}_scaled" and mixed.loss_output == case.loss
    # Design (i): fp32 masters are the trainable inputs, each read through one in-graph Cast to fp16.
    assert mixed.fp16_twin_inputs == () and set(mixed.fp16_weights) == set(case.params)
    train, evaluation = build_training_graphs(mixed.model, case.params, [], [mixed.backprop_output, case.loss])
    types = _io(train.graph)
    for p in case.params:
        assert types[p] == types[f"{p}_grad.accumulation.buffer"] == TensorProto.FLOAT
    assert types[case.loss] == types[LOSS_SCALE_INPUT] == TensorProto.FLOAT
    strip_loss_scaling(evaluation, mixed)
    assert LOSS_SCALE_INPUT not in _io(evaluation.graph) and mixed.backprop_output not in _io(evaluation.graph)
    onnx.checker.check_model(checkable(evaluation))


# -------------------------------------------------------------------------- (5) unsupported op, casts
def test_an_op_without_fp16_kernel_stays_fp32_between_boundary_casts(cases):
    case = cases["mlp"]
    support = {key: key[1] != "Relu" for key in case.support("gpu-like")}
    mixed = case.convert(support)
    assert mixed.fp16_ops == ["Gemm"]
    assert mixed.fp32_nodes == {
        "/model/Relu (Relu)": "no float16 kernel on the provider",
        "/SoftmaxCrossEntropyLoss (SoftmaxCrossEntropyLoss)": "loss tail (kept float32 by design)",
    }
    # x, fc1.weight, fc1.bias, fc2.weight, fc2.bias -> fp16; Gemm1 -> fp32 for Relu; Relu -> fp16 for
    # Gemm2; logits -> fp32 for the loss. The exported MLP has no Cast of its own.
    casts = [n for n in mixed.model.graph.node if n.op_type == "Cast"]
    assert mixed.inserted_casts == len(casts) == 8
    assert sorted(helper.get_attribute_value(n.attribute[0]) for n in casts) == [1, 1, 10, 10, 10, 10, 10, 10]
    inferred = onnx.shape_inference.infer_shapes(mixed.model).graph.value_info
    types = {v.name: v.type.tensor_type.elem_type for v in inferred}
    relu = next(n for n in mixed.model.graph.node if n.op_type == "Relu")
    assert types[relu.input[0]] == types[relu.output[0]] == TensorProto.FLOAT
    gemms = [n for n in mixed.model.graph.node if n.op_type == "Gemm"]
    assert all(types[n.output[0]] == TensorProto.FLOAT16 for n in gemms)


# ---------------------------------------------------------------------- type attributes, ints, ratio
def test_type_carrying_attributes_follow_the_node_precision():
    """Cast ``to``, Constant and ConstantOfShape values become fp16 inside the fp16 region; ints stay."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape_f"], to=f32),  # int -> float feeding fp16 math
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),  # default value: float32 zero
        helper.make_node("Constant", [], ["half"], value=helper.make_tensor("v", f32, [], [0.5])),
        helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("r", f32, [], [0.1])),
        helper.make_node("Mul", ["x", "half"], ["a"]),
        helper.make_node("Add", ["a", "zeros"], ["b"]),
        helper.make_node("Div", ["b", "shape_f"], ["c"]),
        helper.make_node("Dropout", ["c", "ratio"], ["d"]),
        helper.make_node("MatMul", ["d", "w"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f32, [4])],
        [helper.make_tensor_value_info("loss", f32, [])],
        [helper.make_tensor("w", f32, [4, 3], np.ones(12).tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    support = {(d, op): True for d, op, _ in model_op_types(model)}
    mixed = convert_to_mixed_precision(model, trainable=["w"], frozen=[], loss_output="loss", support=support)
    onnx.checker.check_model(checkable(mixed.model), full_check=True)
    by_output = {n.output[0]: n for n in mixed.model.graph.node}
    assert helper.get_attribute_value(by_output["shape_f"].attribute[0]) == TensorProto.FLOAT16
    assert helper.get_attribute_value(by_output["zeros"].attribute[0]).data_type == TensorProto.FLOAT16
    assert helper.get_attribute_value(by_output["half"].attribute[0]).data_type == TensorProto.FLOAT16
    # Dropout's ratio keeps float32 (rounding 0.1 to fp16 would change the op); the loss tail too.
    assert helper.get_attribute_value(by_output["ratio"].attribute[0]).data_type == f32
    assert mixed.fp32_nodes["#10 (ReduceSum)"] == "loss tail (kept float32 by design)"
    assert by_output["shape"].op_type == "Shape"  # int64 shape untouched, no cast on it
    inserted = {n.input[0] for n in mixed.model.graph.node if n.op_type == "Cast" and n.output[0] != "shape_f"}
    assert inserted == {"x", "w", "y"}  # graph input and weight into fp16, MatMul result back to fp32
    x = np.arange(1, 5, dtype=np.float32)
    feeds = {"x": x, LOSS_SCALE_INPUT: np.array(4.0, np.float32)}
    loss, scaled = ort.InferenceSession(mixed.model.SerializeToString(), providers=CPU).run(None, feeds)
    assert loss == pytest.approx(float(3 * (x * 0.5 / 4).sum()), rel=LOSS_RTOL) and scaled == 4 * loss
