"""Torch <-> OrtValue without copies on the installed runtime (`runtime._dlpack`).

The same tests run on both routes: ``make test`` (onnxruntime 1.31.1) and ``make test-onnxblock`` (1.19.2) take the
legacy one, ``make test-latest`` (the newest release the declared range admits, 1.32+) the public one.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer.runtime import DLPACK_ROUTE, from_ortvalue, to_ortvalue
from ort_trainer.runtime._dlpack import dlpack_route

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]


def test_the_route_is_the_one_the_installed_runtime_needs():
    major, minor = (int(p) for p in ort.__version__.split(".")[:2])
    assert DLPACK_ROUTE == ("public" if (major, minor) >= (1, 32) else "legacy")


@pytest.mark.parametrize(
    ("version", "route"),
    [("1.19.2", "legacy"), ("1.31.1", "legacy"), ("1.32.0", "public"), ("1.33.0.dev20261201", "public"),
     ("2.0.0", "public")],
)  # fmt: skip
def test_route_by_version(version, route):
    assert dlpack_route(version) == route


def test_an_unreadable_version_is_named():
    with pytest.raises(ValueError, match=r"onnxruntime version 'nightly' is not of the form"):
        dlpack_route("nightly")


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_a_tensor_becomes_an_ortvalue_over_the_same_memory(dtype):
    tensor = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    value = to_ortvalue(tensor)
    assert value.shape() == [3, 4]
    assert value.data_ptr() == tensor.data_ptr()
    expected = {torch.bool: "tensor(bool)", torch.float16: "tensor(float16)", torch.bfloat16: "tensor(bfloat16)"}
    assert value.data_type() == expected.get(dtype, value.data_type())
    tensor.fill_(1)  # written through torch, read through ORT: the same memory
    if dtype != torch.bfloat16:  # numpy has no bfloat16
        assert np.all(value.numpy() == 1)


def _not_graph() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.BOOL, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.BOOL, ["n"])
    graph = helper.make_graph([helper.make_node("Not", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def test_a_bool_tensor_binds_as_bool_and_comes_back_as_bool():
    session = ort.InferenceSession(_not_graph(), providers=["CPUExecutionProvider"])
    mask = torch.tensor([True, False, True, True])
    io = session.io_binding()
    io.bind_ortvalue_input("x", to_ortvalue(mask))
    io.bind_output("y", "cpu", 0)
    session.run_with_iobinding(io)
    out = from_ortvalue(io._iobinding.get_outputs()[0])
    # runtimes before 1.32 give a bool output as uint8 (the caller views it back: module._graph._as_dtype)
    assert out.dtype == (torch.bool if DLPACK_ROUTE == "public" else torch.uint8)
    assert torch.equal(out.view(torch.bool), ~mask)


def test_an_output_comes_back_without_a_copy():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    io = session.io_binding()
    source = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    io.bind_ortvalue_input("x", to_ortvalue(source))
    io.bind_output("y", "cpu", 0)
    session.run_with_iobinding(io)
    value = io._iobinding.get_outputs()[0]
    out = from_ortvalue(value)
    assert out.data_ptr() == value.data_ptr()
    assert torch.equal(out, source.relu())
