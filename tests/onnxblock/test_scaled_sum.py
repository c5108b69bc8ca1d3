"""An averaged two-way cross-entropy (CLIP's loss) trains on CPU and equals PyTorch.

ONNX Runtime's gradient builder fuses ``Div(a, c1) + Div(b, c2)`` (constant scalars) into ScaledSum,
which has no CPU kernel; `graph._scaled_sum` writes it out again as Mul + Add.
"""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph.onnxblock._scaled_sum import unfuse_scaled_sum

ce = torch.nn.functional.cross_entropy


class TwoWay(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, x):
        labels = torch.arange(len(x))  # a python int when traced: constant labels, constant means
        return (ce(self.a(x), labels) + ce(self.b(x), labels)) / 2


def test_the_averaged_two_way_cross_entropy_trains_like_torch():
    torch.manual_seed(0)
    model = TwoWay()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("x", [4, 8])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)  # Adam would amplify rounding in ~0 gradients
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        loss = trainer.train_step(x)
        opt.zero_grad()
        expected = reference(x)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    weights = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inputs", [2, 3])
def test_unfused_sum_has_the_values_of_scaled_sum(inputs):
    names = [f"x{i}" for i in range(inputs)]
    scales = {f"scale_{i}": 0.5 + i for i in range(inputs)}
    node = helper.make_node("ScaledSum", names, ["y"], domain="com.microsoft", **scales)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    assert unfuse_scaled_sum(model) == 1
    assert {n.op_type for n in model.graph.node} == {"Constant", "CastLike", "Mul", "Add"}
    onnx.checker.check_model(model)
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: torch.randn(3).numpy() for n in names}
    expected = sum(feeds[f"x{i}"] * (0.5 + i) for i in range(inputs))
    torch.testing.assert_close(torch.from_numpy(session.run(None, feeds)[0]), torch.from_numpy(expected))
