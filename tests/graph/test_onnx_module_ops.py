"""`OnnxModule` (the autograd engine's route for a user-given ONNX model) computes each standard op as ONNX Runtime
does: one-node models run through the module's torch ops and through an ``InferenceSession``, outputs compared.
The cases are the semantics a torch op does not share by default (negative slice steps and indices, asymmetric
pads, opset-11 Softmax, integer Div, ONNX's loss attributes...)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_trainer.graph.autograd import OnnxModule

_rng = np.random.default_rng(0)


def _f(*shape):
    return _rng.standard_normal(shape).astype(np.float32)


def _i(values):
    return np.array(values, dtype=np.int64)


# (op, attributes, graph inputs {name: value}, constant inputs {name: value} (initializers), number of outputs,
#  opset). Inputs are passed in the order: graph inputs, then constants (an empty name: an absent input).
CASES = {
    "slice_negative_step": ("Slice", {}, {"x": _f(4, 6)},
                            {"s": _i([-1, 1]), "e": _i([-10**9, 5]), "a": _i([0, 1]), "st": _i([-2, 3])}, 1, 18),
    "gather_negative_indices": ("Gather", {"axis": 1}, {"x": _f(3, 5)}, {"i": _i([[-1, 0], [2, -5]])}, 1, 18),
    "gather_elements": ("GatherElements", {"axis": 1}, {"x": _f(3, 4)}, {"i": _i([[0, -1], [1, 2], [3, 3]])}, 1, 18),
    "split_uneven": ("Split", {"axis": 1, "num_outputs": 3}, {"x": _f(2, 7)}, {}, 3, 18),
    "split_sizes": ("Split", {"axis": 0}, {"x": _f(5, 2)}, {"s": _i([1, 4])}, 2, 18),
    "pad_reflect": ("Pad", {"mode": "reflect"}, {"x": _f(2, 3, 4)}, {"p": _i([0, 1, 2, 0, 1, 1])}, 1, 18),
    "pad_constant_axes": ("Pad", {}, {"x": _f(2, 3)}, {"p": _i([1, 2]), "v": np.array(1.5, np.float32),
                                                       "a": _i([-1])}, 1, 18),
    "softmax_opset11": ("Softmax", {"axis": 1}, {"x": _f(2, 3, 4)}, {}, 1, 11),
    "log_softmax": ("LogSoftmax", {"axis": 1}, {"x": _f(2, 3, 4)}, {}, 1, 18),
    "conv_asymmetric_groups": ("Conv", {"pads": [0, 1, 2, 1], "group": 2, "dilations": [1, 2], "strides": [2, 1]},
                               {"x": _f(1, 4, 7, 8)}, {"w": _f(6, 2, 3, 2), "b": _f(6)}, 1, 18),
    "conv_same_lower": ("Conv", {"auto_pad": "SAME_LOWER", "strides": [2]}, {"x": _f(2, 3, 9)},
                        {"w": _f(4, 3, 4)}, 1, 18),
    "max_pool_ceil": ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1},
                      {"x": _f(1, 2, 7, 8)}, {}, 1, 18),
    "average_pool_with_pad": ("AveragePool", {"kernel_shape": [3], "pads": [1, 1], "count_include_pad": 1},
                              {"x": _f(2, 2, 5)}, {}, 1, 18),
    "average_pool_without_pad": ("AveragePool", {"kernel_shape": [2, 3], "pads": [1, 1, 0, 1]},
                                 {"x": _f(1, 1, 5, 6)}, {}, 1, 18),
    "global_average_pool": ("GlobalAveragePool", {}, {"x": _f(2, 3, 4, 5)}, {}, 1, 18),
    "reshape_zero_and_minus_one": ("Reshape", {}, {"x": _f(2, 3, 4)}, {"s": _i([0, -1, 2])}, 1, 18),
    "unsqueeze_negative": ("Unsqueeze", {}, {"x": _f(2, 3)}, {"a": _i([-1, 0])}, 1, 18),
    "squeeze_all": ("Squeeze", {}, {"x": _f(1, 3, 1, 2)}, {}, 1, 18),
    "expand_both_ways": ("Expand", {}, {"x": _f(3, 1)}, {"s": _i([2, 1, 4])}, 1, 18),
    "tile": ("Tile", {}, {"x": _f(2, 3)}, {"r": _i([2, 1])}, 1, 18),
    "flatten_axis_zero": ("Flatten", {"axis": 0}, {"x": _f(2, 3, 4)}, {}, 1, 18),
    "transpose_default": ("Transpose", {}, {"x": _f(2, 3, 4)}, {}, 1, 18),
    "concat_negative_axis": ("Concat", {"axis": -1}, {"x": _f(2, 3), "y": _f(2, 1)}, {}, 1, 18),
    "reduce_mean_axes_input": ("ReduceMean", {"keepdims": 0}, {"x": _f(2, 3, 4)}, {"a": _i([0, -1])}, 1, 18),
    "reduce_sum_noop": ("ReduceSum", {"noop_with_empty_axes": 1}, {"x": _f(2, 3)}, {"a": _i([])}, 1, 18),
    "reduce_sum_all": ("ReduceSum", {}, {"x": _f(2, 3)}, {}, 1, 18),
    "reduce_logsumexp": ("ReduceLogSumExp", {"axes": [1]}, {"x": _f(2, 3, 4)}, {}, 1, 13),
    "reduce_l2": ("ReduceL2", {}, {"x": _f(2, 3)}, {"a": _i([1])}, 1, 18),
    "reduce_prod": ("ReduceProd", {"keepdims": 0}, {"x": _f(2, 3, 2)}, {"a": _i([0, 2])}, 1, 18),
    "argmax": ("ArgMax", {"axis": 1, "keepdims": 0}, {"x": _f(3, 5)}, {}, 1, 18),
    "cumsum_exclusive_reverse": ("CumSum", {"exclusive": 1, "reverse": 1}, {"x": _f(2, 5)}, {"a": _i(1)}, 1, 18),
    "trilu_lower": ("Trilu", {"upper": 0}, {"x": _f(4, 4)}, {"k": _i(-1)}, 1, 18),
    "einsum": ("Einsum", {"equation": "bij,bjk->bik"}, {"x": _f(2, 3, 4), "y": _f(2, 4, 5)}, {}, 1, 18),
    "where": ("Where", {}, {"c": _f(3, 4) > 0, "x": _f(3, 4), "y": _f(1, 4)}, {}, 1, 18),
    "clip_min_only": ("Clip", {}, {"x": _f(3, 4)}, {"lo": np.array(-0.5, np.float32), "": None}, 1, 18),
    "div_integers": ("Div", {}, {"x": _i([7, -7, 9]), "y": _i([2, 2, -4])}, {}, 1, 18),
    "mod": ("Mod", {}, {"x": _i([7, -7, 9]), "y": _i([3, 3, -4])}, {}, 1, 18),
    "pow_sub_mul": ("Pow", {}, {"x": np.abs(_f(2, 3)) + 0.5}, {"e": np.array(1.5, np.float32)}, 1, 18),
    "gemm_trans_alpha_beta": ("Gemm", {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
                              {"x": _f(4, 3)}, {"w": _f(5, 4), "c": _f(5)}, 1, 18),
    "matmul_broadcast": ("MatMul", {}, {"x": _f(2, 3, 4)}, {"w": _f(4, 5)}, 1, 18),
    "layer_norm_three_outputs": ("LayerNormalization", {"axis": 1, "epsilon": 1e-3}, {"x": _f(2, 3, 4)},
                                 {"g": _f(3, 4), "b": _f(3, 4)}, 3, 18),
    "batch_norm_inference": ("BatchNormalization", {"epsilon": 1e-3}, {"x": _f(2, 3, 4)},
                             {"g": _f(3), "b": _f(3), "m": _f(3), "v": np.abs(_f(3)) + 0.5}, 1, 18),
    "instance_norm": ("InstanceNormalization", {}, {"x": _f(2, 3, 5)}, {"g": _f(3), "b": _f(3)}, 1, 18),
    "gelu_tanh": ("Gelu", {"approximate": "tanh"}, {"x": _f(3, 4)}, {}, 1, 20),
    "hard_sigmoid": ("HardSigmoid", {"alpha": 0.3}, {"x": _f(3, 4)}, {}, 1, 18),
    "leaky_relu": ("LeakyRelu", {"alpha": 0.2}, {"x": _f(3, 4)}, {}, 1, 18),
    "selu": ("Selu", {}, {"x": _f(3, 4)}, {}, 1, 18),
    "elu": ("Elu", {"alpha": 0.7}, {"x": _f(3, 4)}, {}, 1, 18),
    "prelu": ("PRelu", {}, {"x": _f(2, 3, 4)}, {"s": _f(3, 1)}, 1, 18),
    "cast_to_int": ("Cast", {"to": TensorProto.INT32}, {"x": _f(3, 4) * 5}, {}, 1, 18),
    "shape_start_end": ("Shape", {"start": 1, "end": -1}, {"x": _f(2, 3, 4, 5)}, {}, 1, 18),
    "softmax_cross_entropy_weights_ignore": (
        "SoftmaxCrossEntropyLoss", {"ignore_index": 1, "reduction": "mean"},
        {"x": _f(6, 4, 2), "y": _i([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2], [0, 1]])}, {"w": np.abs(_f(4))}, 2, 18),
    "negative_log_likelihood_none": ("NegativeLogLikelihoodLoss", {"reduction": "none"},
                                     {"x": _f(5, 3), "y": _i([0, 2, 1, 1, 0])}, {}, 1, 18),
}  # fmt: skip
_POSITIVE = {"Log", "Sqrt", "Reciprocal"}
for _op in ("Abs", "Ceil", "Cos", "Erf", "Exp", "Floor", "Identity", "Log", "Neg", "Reciprocal", "Relu", "Round",
            "Sigmoid", "Sign", "Sin", "Softplus", "Sqrt", "Tanh", "HardSwish", "IsNaN"):  # fmt: skip
    _x = np.abs(_f(3, 4)) + 0.1 if _op in _POSITIVE else _f(3, 4) * 3
    CASES[f"unary_{_op}"] = (_op, {}, {"x": _x}, {}, 1, 18)
for _op in ("Add", "Sub", "Mul", "Div", "Pow", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
            "Min", "Mean", "Sum"):  # fmt: skip
    _x = np.round(_f(3, 4)) if _op == "Equal" else np.abs(_f(3, 4)) + 0.1
    CASES[f"broadcast_{_op}"] = (_op, {}, {"x": _x, "y": np.round(_f(1, 4)) if _op == "Equal" else _f(1, 4)}, {}, 1, 18)
for _op in ("And", "Or", "Xor"):
    CASES[f"logical_{_op}"] = (_op, {}, {"x": _f(3, 4) > 0, "y": _f(1, 4) > 0}, {}, 1, 18)
CASES["logical_Not"] = ("Not", {}, {"x": _f(3, 4) > 0}, {}, 1, 18)
CASES["argmin_keepdims"] = ("ArgMin", {"axis": -1}, {"x": _f(3, 5)}, {}, 1, 18)
CASES["reduce_max_min"] = ("ReduceMax", {"keepdims": 0}, {"x": _f(3, 5)}, {"a": _i([1])}, 1, 18)
CASES["reduce_min"] = ("ReduceMin", {}, {"x": _f(3, 5)}, {"a": _i([0])}, 1, 18)
CASES["reduce_sum_square"] = ("ReduceSumSquare", {}, {"x": _f(3, 5)}, {"a": _i([1])}, 1, 18)
CASES["global_max_pool"] = ("GlobalMaxPool", {}, {"x": _f(2, 3, 4)}, {}, 1, 18)
CASES["cast_like"] = ("CastLike", {}, {"x": _f(3, 4) * 4, "y": _i([1])}, {}, 1, 18)


def _model(op, attrs, feeds, constants, outputs, opset) -> onnx.ModelProto:
    names = [*feeds, *constants]
    out = [f"out{i}" for i in range(outputs)]
    node = helper.make_node(op, names, out, name=f"the_{op}", **attrs)
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()
    ]
    outs = [onnx.ValueInfoProto(name=n) for n in out]  # types left to ONNX Runtime's inference
    inits = [numpy_helper.from_array(v, n) for n, v in constants.items() if n]
    graph = helper.make_graph([node], "g", inputs, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_op_computes_what_onnxruntime_computes(case):
    op, attrs, feeds, constants, outputs, opset = CASES[case]
    model = _model(op, attrs, feeds, constants, outputs, opset)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    state = {n: torch.from_numpy(v) for n, v in constants.items() if n and v.dtype == np.float32}
    statistics = {"m", "v"} if op == "BatchNormalization" else set()  # the trainer holds these frozen
    module = OnnxModule(model, state, trainable=set(state) - statistics).eval()
    got = module(**{n: torch.from_numpy(np.asarray(v)) for n, v in feeds.items()})
    assert list(got) == [f"out{i}" for i in range(outputs)]
    for name, want in zip(got, expected, strict=True):
        value = got[name].detach().numpy()
        assert value.dtype == want.dtype and value.shape == want.shape, (name, value.dtype, want.dtype, value.shape)
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6, err_msg=f"{case}: {name}")


def test_dropout_drops_only_in_training_mode_and_its_mask_says_where():
    x = _f(64, 32)
    feeds = {"x": x}
    model = _model("Dropout", {}, feeds, {"r": np.array(0.25, np.float32), "t": np.array(True)}, 2, 18)
    module = OnnxModule(model, {}, trainable=())
    torch.manual_seed(0)
    out = module.train()(x=torch.from_numpy(x))
    y, mask = out["out0"], out["out1"]
    assert mask.dtype == torch.bool and 0.6 < mask.float().mean().item() < 0.9
    torch.testing.assert_close(y, torch.where(mask, torch.from_numpy(x) / 0.75, torch.zeros(())))
    out = module.eval()(x=torch.from_numpy(x))
    assert torch.equal(out["out0"], torch.from_numpy(x)) and bool(out["out1"].all())
    not_training = _model("Dropout", {}, feeds, {"r": np.array(0.25, np.float32)}, 1, 18)  # training_mode: False
    assert torch.equal(OnnxModule(not_training, {}, ()).train()(x=torch.from_numpy(x))["out0"], torch.from_numpy(x))


def test_shape_arithmetic_is_computed_at_trace_time_by_the_reference_implementation():
    """A Reshape whose shape comes from Shape -> Gather -> Concat (what exporters write for ``x.view(b, -1)``) and
    a ConstantOfShape / Range, which have no torch route of their own: known at trace time, they need none."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero_axis"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("ConstantOfShape", ["width"], ["ones"], value=numpy_helper.from_array(np.ones(1, "float32"))),
        helper.make_node("Range", ["zero", "batch", "one"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["positions_f", "one_axis"], ["column"]),
        helper.make_node("Add", ["flat", "column"], ["shifted"]),
        helper.make_node("Add", ["shifted", "ones"], ["out"]),
    ]  # fmt: skip
    constants = {"zero": _i(0), "one": _i(1), "zero_axis": _i([0]), "one_axis": _i([1]), "minus_one": _i([-1]),
                 "width": _i([6])}  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2, 3])],
        [onnx.ValueInfoProto(name="out")],
        [numpy_helper.from_array(v, n) for n, v in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = _f(4, 2, 3)
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = OnnxModule(model, {}, ())(x=torch.from_numpy(x))["out"]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_initializer_names_that_cannot_be_parameter_paths_are_refused_every_one():
    """Parameters live under their ONNX names (``a.b`` is the parameter ``b`` of the submodule ``a``): a name that
    is also another's submodule, an empty part, or a part that is an attribute of torch.nn.Module cannot."""
    names = ["enc", "enc.w", "head..b", "model.training", "fine.weight"]
    nodes = [helper.make_node("Mul", ["x", n], [f"y{i}"]) for i, n in enumerate(names)]
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(len(names))], ["out"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [onnx.ValueInfoProto(name="out")],
        [numpy_helper.from_array(np.ones(2, np.float32), n) for n in names],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    state = {n: torch.ones(2) for n in names}
    with pytest.raises(ValueError, match=r"cannot be torch parameter names \['enc', 'head\.\.b', 'model\.training'\]"):
        OnnxModule(model, state, trainable=set(names))
    renamed = {"enc": "enc_all", "head..b": "head.b", "model.training": "model.t"}
    for node in model.graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
    for init in model.graph.initializer:
        init.name = renamed.get(init.name, init.name)
    state = {renamed.get(n, n): t for n, t in state.items()}
    module = OnnxModule(model, state, trainable=set(state))
    assert sorted(name for name, _ in module.named_parameters()) == sorted(state)
    torch.testing.assert_close(module(x=torch.full((2,), 2.0))["out"], torch.full((2,), 10.0))
