"""float64 models and bfloat16 autocast under `ORTModule` on CPU: equal to eager where ONNX Runtime's CPU provider
has the kernels, else a TypeError that names the op, the dtype and the way out (float32), not the exporter.

ONNX Runtime's CPU execution provider has float64 kernels for MatMul, Gemm, Tanh, Softmax... but none for Erf
(GELU) or Conv, and no bfloat16 kernels for MatMul or Gemm: such a graph is exported fine and the session
refuses to load it ("Could not find an implementation for Erf(13) node ...").
"""

from __future__ import annotations

import copy

import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTModule
from ort_trainer.graph.autograd import TraceError, missing_kernel_error


class _MLP(torch.nn.Module):
    """A class of this file's own, not ``nn.Sequential``: Dynamo keeps what it learnt of the sizes a forward was
    called with per code object, so compiling ``Sequential.forward`` here would change the graphs another test file
    run later in the same process (an xdist worker) builds for it."""

    def __init__(self, activation: torch.nn.Module, norm: torch.nn.Module | None = None):
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.norm = norm if norm is not None else torch.nn.Identity()
        self.activation = activation
        self.second = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.second(self.activation(self.norm(self.first(x))))


# onnxruntime-training 1.19.2's optimizer fuses the backward's transposed float64 MatMul into a com.microsoft
# FusedMatMul, which has a float32 kernel only; stock onnxruntime 1.31+ keeps the MatMul
_FUSES_FLOAT64_MATMUL = tuple(int(v) for v in ort.__version__.split(".")[:2]) < (1, 20)


def test_a_float64_model_of_ops_with_float64_kernels_trains_as_in_eager():
    torch.manual_seed(0)
    model = _MLP(torch.nn.Tanh()).double()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    batches = [(torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))) for _ in range(3)]
    if _FUSES_FLOAT64_MATMUL:  # then the error names the fused node and the dtype, not the exporter
        with pytest.raises(TypeError, match=r"no kernel for com\.microsoft\.FusedMatMul.*float64") as raised:
            torch.nn.functional.cross_entropy(wrapped(batches[0][0]), batches[0][1]).backward()
        assert "exporter" not in str(raised.value) and "float32" in str(raised.value)
        return
    for module in (wrapped, reference):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for x, label in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(x), label)
            assert loss.dtype == torch.float64
            loss.backward()
            opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_a_float64_model_with_an_op_without_a_float64_cpu_kernel_names_the_op_and_dtype():
    torch.manual_seed(0)
    wrapped = ORTModule(_MLP(torch.nn.GELU()).double())
    with pytest.raises(TypeError, match=r"CPU.*no kernel for Erf.*float64") as raised:
        wrapped(torch.randn(4, 6, dtype=torch.float64))
    message = str(raised.value)
    assert "float32" in message  # the way out
    assert "exporter" not in message  # not blamed on the exporter


def test_bfloat16_autocast_names_the_op_without_a_bfloat16_cpu_kernel_and_says_drop_autocast():
    torch.manual_seed(0)
    wrapped = ORTModule(_MLP(torch.nn.ReLU()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _MLP(torch.nn.ReLU())(torch.randn(4, 6)).dtype == torch.bfloat16  # eager computes in bfloat16
        with pytest.raises(TypeError, match=r"CPU.*no kernel for (Gemm|MatMul).*bfloat16") as raised:
            wrapped(torch.randn(4, 6))
    message = str(raised.value)
    assert "autocast" in message and "float32" in message
    assert "exporter" not in message


def test_a_float64_layer_norm_the_exporter_computes_in_float32_is_refused_naming_the_op_not_run():
    """The exporter's LayerNormalization keeps its mean and 1/std in float32 (``stash_type``) where PyTorch's are
    float64: the backward then got float32 tensors for float64 inputs (a raw ONNX Runtime error at the backward)."""
    torch.manual_seed(0)
    model = _MLP(torch.nn.Identity(), torch.nn.LayerNorm(8)).double()
    wrapped = ORTModule(model)
    with pytest.raises(TypeError, match=r"LayerNormalization.*float32.*float64") as raised:
        wrapped(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    assert "model.float()" in str(raised.value)


def test_only_a_float64_or_low_precision_node_without_a_kernel_is_told_as_a_dtype_problem():
    """A float32 node without a kernel is an op the provider lacks whatever the dtype: not `missing_kernel_error`'s."""
    refusal = RuntimeError(
        "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for Erf(13) node with name 'erf'"
    )
    for elem, expected in (
        (TensorProto.DOUBLE, "float64"),
        (TensorProto.BFLOAT16, "bfloat16"),
        (TensorProto.FLOAT, None),
    ):
        graph = helper.make_graph(
            [helper.make_node("Erf", ["x"], ["y"], name="erf")],
            "g",
            [helper.make_tensor_value_info("x", elem, [2])],
            [helper.make_tensor_value_info("y", elem, [2])],
        )
        error = missing_kernel_error(refusal, helper.make_model(graph), "CPUExecutionProvider", "the graph")
        if expected is None:
            assert error is None
        else:
            assert isinstance(error, TypeError) and isinstance(error, TraceError)
            assert f"CPU execution provider has no kernel for Erf (opset 13) with {expected} inputs" in str(error)
