"""A small training artifact written by hand with ``onnx.helper``, following the artifact format
(docs/anywhere.md) without the exporter: linear regression with an input Dropout drawn from a "random" input,
AdamW in standard ops (bias corrections in float64, the step an int64 input), a float32 buffer that counts the
samples seen, and ``grad_norm`` as an extra output.

It proves the JS driver against the contract independently of ``ort_trainer.export_training``: every feature of
the manifest that the driver must follow (state by name, symbolic dims, a product dim, random inputs, scalars,
updated outputs, an extra output, an eval graph) is in it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from safetensors.numpy import save_file

FORMAT = "ort_trainer.training_artifact"
FEATURES = 4
P_DROP = 0.25
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
PARAMETERS = {"linear.weight": (FEATURES, 1), "linear.bias": (1,)}


def _adamw(nodes: list, name: str, grad: str) -> list[str]:
    """Nodes of one AdamW update (PyTorch's formula); returns the names of [param, exp_avg, exp_avg_sq] out."""
    b1, b2 = BETAS
    p, m, v = name, f"optimizer.{name}.exp_avg", f"optimizer.{name}.exp_avg_sq"
    t = name.replace(".", "_")

    def const(label: str, value: float) -> str:
        out = f"{t}_{label}"
        nodes.append(helper.make_node("Constant", [], [out], value_float=value))
        return out

    nodes += [
        helper.make_node("Mul", [p, "decay"], [f"{t}_decayed"]),
        helper.make_node("Mul", [m, const("b1", b1)], [f"{t}_m_a"]),
        helper.make_node("Mul", [grad, const("one_minus_b1", 1 - b1)], [f"{t}_m_b"]),
        helper.make_node("Add", [f"{t}_m_a", f"{t}_m_b"], [f"{m}.new"]),
        helper.make_node("Mul", [v, const("b2", b2)], [f"{t}_v_a"]),
        helper.make_node("Mul", [grad, grad], [f"{t}_g2"]),
        helper.make_node("Mul", [f"{t}_g2", const("one_minus_b2", 1 - b2)], [f"{t}_v_b"]),
        helper.make_node("Add", [f"{t}_v_a", f"{t}_v_b"], [f"{v}.new"]),
        helper.make_node("Sqrt", [f"{v}.new"], [f"{t}_sqrt_v"]),
        helper.make_node("Div", [f"{t}_sqrt_v", "sqrt_bc2"], [f"{t}_denom_a"]),
        helper.make_node("Add", [f"{t}_denom_a", const("eps", EPS)], [f"{t}_denom"]),
        helper.make_node("Div", [f"{m}.new", f"{t}_denom"], [f"{t}_ratio"]),
        helper.make_node("Mul", [f"{t}_ratio", "step_size"], [f"{t}_update"]),
        helper.make_node("Sub", [f"{t}_decayed", f"{t}_update"], [f"{p}.new"]),
    ]
    return [f"{p}.new", f"{m}.new", f"{v}.new"]


def _value(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _shared_nodes() -> list:
    """lr and step -> decay = 1 - lr*wd, step_size = lr / (1 - b1^step), sqrt_bc2 = sqrt(1 - b2^step)."""
    b1, b2 = BETAS
    return [
        helper.make_node("Cast", ["step"], ["step_d"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["lr"], ["lr_d"], to=TensorProto.DOUBLE),
        helper.make_node("Constant", [], ["one_d"], value=helper.make_tensor("", TensorProto.DOUBLE, [], [1.0])),
        helper.make_node("Constant", [], ["b1_d"], value=helper.make_tensor("", TensorProto.DOUBLE, [], [b1])),
        helper.make_node("Constant", [], ["b2_d"], value=helper.make_tensor("", TensorProto.DOUBLE, [], [b2])),
        helper.make_node("Pow", ["b1_d", "step_d"], ["b1_t"]),
        helper.make_node("Pow", ["b2_d", "step_d"], ["b2_t"]),
        helper.make_node("Sub", ["one_d", "b1_t"], ["bc1"]),
        helper.make_node("Sub", ["one_d", "b2_t"], ["bc2"]),
        helper.make_node("Div", ["lr_d", "bc1"], ["step_size_d"]),
        helper.make_node("Cast", ["step_size_d"], ["step_size"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["bc2"], ["sqrt_bc2_d"]),
        helper.make_node("Cast", ["sqrt_bc2_d"], ["sqrt_bc2"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["wd"], value_float=WEIGHT_DECAY),
        helper.make_node("Constant", [], ["one_f"], value_float=1.0),
        helper.make_node("Mul", ["lr", "wd"], ["lr_wd"]),
        helper.make_node("Sub", ["one_f", "lr_wd"], ["decay"]),
    ]


def _forward(nodes: list, x: str) -> None:
    """pred = x @ W + b; loss = mean((pred - y)^2); the nodes' outputs: pred, diff, loss."""
    nodes += [
        helper.make_node("MatMul", [x, "linear.weight"], ["xw"]),
        helper.make_node("Add", ["xw", "linear.bias"], ["pred"]),
        helper.make_node("Sub", ["pred", "y"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]


def _train_graph(state: list[dict]) -> onnx.ModelProto:
    nodes = [
        # Dropout on the inputs: keep where random >= p, scaled by 1/(1-p); random_0 is [batch, 4] and
        # random_1 ("batch*4", a product dim) is drawn but only summed into the loss times 0, to check its shape
        helper.make_node("Constant", [], ["p"], value_float=P_DROP),
        helper.make_node("GreaterOrEqual", ["random_0", "p"], ["keep"]),
        helper.make_node("Cast", ["keep"], ["keep_f"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["scale"], value_float=1 / (1 - P_DROP)),
        helper.make_node("Mul", ["keep_f", "scale"], ["mask"]),
        helper.make_node("Mul", ["x", "mask"], ["xd"]),
    ]
    _forward(nodes, "xd")
    nodes += [
        helper.make_node("Size", ["diff"], ["n"]),
        helper.make_node("Cast", ["n"], ["n_f"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Div", ["two", "n_f"], ["two_over_n"]),
        helper.make_node("Mul", ["diff", "two_over_n"], ["g_pred"]),
        helper.make_node("Transpose", ["xd"], ["xd_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["xd_t", "g_pred"], ["g_weight"]),
        helper.make_node("Constant", [], ["axis0"], value=helper.make_tensor("", TensorProto.INT64, [1], [0])),
        helper.make_node("ReduceSum", ["g_pred", "axis0"], ["g_bias"], keepdims=0),
        # grad_norm, and random_1 * 0 folded into it so that the graph reads random_1
        helper.make_node("ReduceSumSquare", ["g_weight"], ["gw2"], keepdims=0),
        helper.make_node("ReduceSumSquare", ["g_bias"], ["gb2"], keepdims=0),
        helper.make_node("Add", ["gw2", "gb2"], ["g2"]),
        helper.make_node("ReduceSum", ["random_1"], ["r1_sum"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value_float=0.0),
        helper.make_node("Mul", ["r1_sum", "zero"], ["r1_zero"]),
        helper.make_node("Add", ["g2", "r1_zero"], ["g2_plus"]),
        helper.make_node("Sqrt", ["g2_plus"], ["grad_norm"]),
        # the buffer: samples seen
        helper.make_node("Shape", ["x"], ["x_shape"], start=0, end=1),
        helper.make_node("ReduceSum", ["x_shape"], ["batch_n"], keepdims=0),
        helper.make_node("Cast", ["batch_n"], ["batch_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["seen", "batch_f"], ["seen.new"]),
        *_shared_nodes(),
    ]
    outputs = ["loss", "grad_norm", "seen.new"]
    for name, grad in (("linear.weight", "g_weight"), ("linear.bias", "g_bias")):
        outputs += _adamw(nodes, name, grad)
    inputs = [_value(e["name"], TensorProto.FLOAT, e["shape"]) for e in state]
    inputs += [
        _value("x", TensorProto.FLOAT, ["batch", FEATURES]),
        _value("y", TensorProto.FLOAT, ["batch", 1]),
        _value("lr", TensorProto.FLOAT, []),
        _value("step", TensorProto.INT64, []),
        _value("random_0", TensorProto.FLOAT, ["batch", FEATURES]),
        _value("random_1", TensorProto.FLOAT, ["batch_x4"]),
    ]
    shapes = {e["name"]: e["shape"] for e in state}
    values = [_value("loss", TensorProto.FLOAT, []), _value("grad_norm", TensorProto.FLOAT, [])]
    values += [_value(o, TensorProto.FLOAT, shapes[o.removesuffix(".new")]) for o in outputs[2:]]
    graph = helper.make_graph(nodes, "train_step", inputs, values)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _eval_graph() -> onnx.ModelProto:
    nodes: list = []
    _forward(nodes, "x")
    inputs = [
        _value("linear.weight", TensorProto.FLOAT, [FEATURES, 1]),
        _value("linear.bias", TensorProto.FLOAT, [1]),
        _value("x", TensorProto.FLOAT, ["batch", FEATURES]),
        _value("y", TensorProto.FLOAT, ["batch", 1]),
    ]
    outputs = [_value("loss", TensorProto.FLOAT, []), _value("pred", TensorProto.FLOAT, ["batch", 1])]
    graph = helper.make_graph(nodes, "eval_step", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def write_linear_artifact(folder: Path, seed: int = 0) -> Path:
    """Write the artifact folder (manifest.json, train_step.onnx, eval_step.onnx, state.safetensors); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    state_values: dict[str, np.ndarray] = {}
    state = []
    for name, shape in PARAMETERS.items():
        state_values[name] = rng.standard_normal(shape).astype(np.float32) * 0.5
        state.append({"name": name, "dtype": "float32", "shape": list(shape), "role": "parameter"})
    state.append({"name": "seen", "dtype": "float32", "shape": [], "role": "buffer"})
    state_values["seen"] = np.zeros((), np.float32)
    for name, shape in PARAMETERS.items():
        for slot in ("exp_avg", "exp_avg_sq"):
            key = f"optimizer.{name}.{slot}"
            state.append({"name": key, "dtype": "float32", "shape": list(shape), "role": "optimizer"})
            state_values[key] = np.zeros(shape, np.float32)
    train = _train_graph(state)
    onnx.checker.check_model(train, full_check=True)
    onnx.save(train, folder / "train_step.onnx")
    onnx.save(_eval_graph(), folder / "eval_step.onnx")
    save_file(state_values, str(folder / "state.safetensors"), metadata={"format": FORMAT, "step": "0"})
    manifest = {
        "format": FORMAT,
        "version": 1,
        "versions": {"ort_trainer": "tests", "onnx": onnx.__version__, "opset": 18},
        "files": {"train": "train_step.onnx", "eval": "eval_step.onnx", "state": "state.safetensors"},
        "dims": ["batch"],
        "inputs": [
            {"name": "x", "dtype": "float32", "shape": ["batch", FEATURES]},
            {"name": "y", "dtype": "float32", "shape": ["batch", 1]},
        ],
        "state": state,
        "random": [
            {"name": "random_0", "kind": "uniform", "dtype": "float32", "shape": ["batch", FEATURES]},
            {"name": "random_1", "kind": "normal", "dtype": "float32", "shape": [f"batch*{FEATURES}"]},
        ],
        "train": {
            "inputs": [i.name for i in train.graph.input],
            "scalars": {"lr": "float32", "step": "int64"},
            "loss": "loss",
            "updated": {e["name"]: f"{e['name']}.new" for e in state},
            "extra_outputs": ["grad_norm"],
        },
        "eval": {"inputs": ["linear.weight", "linear.bias", "x", "y"], "outputs": ["loss", "pred"]},
        "optimizer": {
            "name": "AdamW",
            "hyper": {"betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
            "max_grad_norm": None,
        },
        "step": 0,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder
