"""ONNX models with their loss inside, as users hand them to ``ORTTrainer``: tiny torch models (+ loss) exported by
the TorchScript exporter in training mode, and the torch model to check them against, holding the ONNX weights."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import onnx
import torch
from onnx import numpy_helper

from tests.models import CNN, CNN_DESC, MLP, MLP_DESC, cnn_batches, mlp_batches

ce = torch.nn.functional.cross_entropy


class WithLoss(torch.nn.Module):
    """``loss_fn(model(x), label)``: the module that is exported (its parameters are named ``m.<name>``)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.m = model
        self.loss_fn = loss_fn

    def forward(self, x, label):
        return self.loss_fn(self.m(x), label)


class Flattening(torch.nn.Module):
    """Embedding -> LayerNorm -> GELU -> ``view(batch, -1)`` -> Linear: the export computes the view's shape from
    the input's (Shape, Gather, Concat, Reshape), and GELU is written with Erf."""

    def __init__(self, vocab: int = 12, d: int = 6, seq: int = 5, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(seq * d, classes)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.embed(x)))
        return self.head(h.view(h.shape[0], -1))


def flattening_batches(steps: int, batch: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 12, (batch, 5), generator=g), torch.randint(0, 3, (batch,), generator=g))
        for _ in range(steps)
    ]


FLATTENING_DESC = {"inputs": [("x", ["batch", 5]), ("label", ["batch"])], "outputs": [("loss", [], True)]}

# name -> (model class, model_desc, batches)
ONNX_CASES = {
    "mlp": (MLP, MLP_DESC, mlp_batches),
    "cnn": (CNN, CNN_DESC, cnn_batches),
    "flattening": (Flattening, FLATTENING_DESC, flattening_batches),
}


def export_with_loss(model: torch.nn.Module, batch, loss_fn: Callable = ce) -> onnx.ModelProto:
    """``model`` + ``loss_fn`` as an ONNX model with inputs ``x``, ``label`` and the output ``loss``."""
    buffer = io.BytesIO()
    torch.onnx.export(
        WithLoss(copy.deepcopy(model), loss_fn), tuple(batch), buffer, input_names=["x", "label"],
        output_names=["loss"], dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}}, opset_version=17,
        do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING, dynamo=False,
    )  # fmt: skip
    return onnx.load_from_string(buffer.getvalue())


def onnx_case(name: str, steps: int = 4) -> tuple[onnx.ModelProto, torch.nn.Module, dict, list]:
    """(ONNX model, the torch model holding the ONNX model's initial values, model_desc, batches) of a case.

    The export runs a training-mode forward, which moves BatchNorm statistics: the reference takes the values the
    ONNX model holds, not the ones it was exported from."""
    cls, desc, batches = ONNX_CASES[name]
    torch.manual_seed(0)
    model = cls()
    data = batches(steps)
    exported = export_with_loss(model, data[0])
    values = {
        i.name.removeprefix("m."): torch.from_numpy(numpy_helper.to_array(i).copy()) for i in exported.graph.initializer
    }
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in values:
                tensor.copy_(values[name])
    return exported, model, desc, data


def torch_sgd_steps(model: torch.nn.Module, batches, lr: float = 0.1) -> list[torch.Tensor]:
    """The losses of plain torch SGD steps over ``batches`` (cross-entropy), the reference both engines match."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for x, label in batches:
        opt.zero_grad()
        loss = ce(model(x), label)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_state_matches(trainer, reference: torch.nn.Module) -> None:
    """The trainer's weights equal the trained torch ``reference`` (wrapped as ``m``), name by name."""
    state = trainer.state_dict()["model"]["full_precision"]
    expected = {f"m.{k}": v for k, v in reference.state_dict().items() if v.is_floating_point()}
    assert set(state) == set(expected)
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=1e-5, msg=name)
