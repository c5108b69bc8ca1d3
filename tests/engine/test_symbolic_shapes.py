"""One graph per model and mode for every size of the dims ``model_desc`` names (issue V): the autograd engine's
symbolic graphs train, evaluate and accumulate equal to PyTorch at every batch size and length, draw Dropout masks
of each batch's shape, resume exactly across shapes, and fall back to one graph per shape, said once with the
line, where the model's code assumes something of a size."""

from __future__ import annotations

import copy
import logging

import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.hf_tiny import GPT2, HF_DESC, token_loss

# (batch, seq): growing and shrinking lengths, batch sizes 1 to 4 (an epoch's last batch), and back
SHAPES = [(4, 8), (2, 5), (3, 12), (1, 7), (4, 8), (2, 3)]


def _batch(rows: int, length: int, g: torch.Generator, pad: bool = True):
    ids = torch.randint(1, 50, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if pad and length > 2:  # the last row padded, as a collator pads to the batch's longest example
        mask[-1, length // 2 :] = 0
    label = ids.masked_fill(mask == 0, -100)
    return ids, mask, label


def _trainer(model, config=None, **options):
    options = {"utils": {"engine": "autograd", "grad_norm_clip": False}, **options}
    return ORTTrainer(model, HF_DESC, config or optim.SGDConfig(lr=0.1), loss_fn=token_loss, options=options)


def _builds(caplog) -> int:
    return caplog.text.count("phase 'trace and export the training graph'") + caplog.text.count("new input shapes")


def test_one_graph_trains_and_evaluates_like_torch_at_every_shape(caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    torch.manual_seed(0)
    model = GPT2(layers=2)
    reference = copy.deepcopy(model)
    trainer = _trainer(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for rows, length in SHAPES:
        ids, mask, label = _batch(rows, length, g)
        loss = trainer.train_step(ids, mask, label)
        opt.zero_grad()
        expected = token_loss(reference(ids, mask), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=key)
    reference.eval()
    for rows, length in [(5, 9), (1, 4)]:  # eval batches of other sizes
        ids, mask, label = _batch(rows, length, g)
        with torch.no_grad():
            expected = token_loss(reference(ids, mask), label)
        torch.testing.assert_close(trainer.eval_step(ids, mask, label), expected, rtol=1e-5, atol=1e-6)
    assert _builds(caplog) == 1, caplog.text  # one training graph; the eval graph is built once (not logged here)
    assert "new input shapes" not in caplog.text


def test_gradient_accumulation_over_batches_of_different_lengths_equals_torch(caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    torch.manual_seed(0)
    model = GPT2()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, batch={"gradient_accumulation_steps": 2})
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for step, (rows, length) in enumerate(SHAPES[:4]):
        ids, mask, label = _batch(rows, length, g)
        trainer.train_step(ids, mask, label)
        (token_loss(reference(ids, mask), label) / 2).backward()
        if step % 2 == 1:
            opt.step()
            opt.zero_grad()
    state = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert _builds(caplog) == 1


def _dropout_losses(steps, resume_at=None, tmp_path=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 50))
    desc = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}

    def loss_fn(logits, label):
        return token_loss(logits, label)

    def new_trainer():
        options = {"utils": {"engine": "autograd"}}
        return ORTTrainer(copy.deepcopy(model), desc, optim.AdamConfig(lr=1e-2), loss_fn=loss_fn, options=options)

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 50, shape, generator=g) for shape in SHAPES[:steps]]
    trainer, losses = new_trainer(), []
    for step, ids in enumerate(batches):
        if step == resume_at:
            trainer.save_checkpoint(tmp_path / "ckpt.ortcp")
            trainer = new_trainer()
            trainer.load_checkpoint(tmp_path / "ckpt.ortcp")
        losses.append(float(trainer.train_step(ids, ids)))
    return losses


def test_dropout_masks_take_each_batch_s_shape_and_resume_exactly_across_shapes(tmp_path):
    uninterrupted = _dropout_losses(5)
    assert _dropout_losses(5) == uninterrupted  # the masks are a function of (seed, step), whatever the shape
    assert _dropout_losses(5, resume_at=3, tmp_path=tmp_path) == uninterrupted


class _LengthBranch(torch.nn.Module):
    """Python control flow on a size: a graph traced at length 8 holds only for lengths over 4."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50)

    def forward(self, ids):
        hidden = self.embed(ids)
        if ids.shape[1] > 4:  # the guard
            hidden = hidden * 2
        return self.head(hidden)


def test_a_size_the_code_branches_on_gets_its_own_graph_said_once_with_the_line():
    torch.manual_seed(0)
    model = _LengthBranch()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    options = {"utils": {"engine": "autograd", "grad_norm_clip": False}}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=token_loss, options=options)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    with pytest.warns(UserWarning, match=r"assumes seq > 4 .*test_symbolic_shapes\.py:\d+.*builds a graph for this"):
        for length in (8, 6, 3, 2, 7):
            ids = torch.randint(0, 50, (2, length), generator=g)
            loss = trainer.train_step(ids, ids)
            opt.zero_grad()
            expected = token_loss(reference(ids), ids)
            expected.backward()
            opt.step()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)  # never the wrong branch


def test_save_as_onnx_writes_the_named_dims_symbolic(tmp_path):
    torch.manual_seed(0)
    trainer = _trainer(GPT2())
    g = torch.Generator().manual_seed(5)
    trainer.train_step(*_batch(2, 6, g))
    trainer.eval_step(*_batch(3, 4, g))
    trainer.save_as_onnx(str(tmp_path / "model.onnx"))
    model = onnx.load(str(tmp_path / "model.onnx"))
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["input_ids"] == ["batch", "seq"] and dims["label"] == ["batch", "seq"]


class _SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(6)
        self.conv2 = torch.nn.Conv2d(6, 8, 3, stride=2)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.head(torch.relu(self.conv2(x)).mean((2, 3)))


def test_a_vision_model_fed_images_of_several_sizes_trains_one_graph_like_torch(caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    torch.manual_seed(0)
    model = _SmallCNN()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("x", ["batch", 3, "height", "width"]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    options = {"utils": {"engine": "autograd", "grad_norm_clip": False}}
    ce = torch.nn.functional.cross_entropy
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=ce, options=options)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(6)
    for rows, height, width in [(4, 16, 16), (3, 24, 20), (4, 16, 16), (2, 11, 13)]:  # two sizes, then another
        x, label = torch.randn(rows, 3, height, width, generator=g), torch.randint(0, 4, (rows,), generator=g)
        loss = trainer.train_step(x, label)
        opt.zero_grad()
        expected = ce(reference(x), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():  # BatchNorm's running statistics included
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=key)
    reference.eval()
    x, label = torch.randn(5, 3, 9, 30, generator=g), torch.randint(0, 4, (5,), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(x, label), ce(reference(x), label), rtol=1e-5, atol=1e-6)
    assert _builds(caplog) == 1, caplog.text


def test_a_checkpoint_does_not_depend_on_the_shapes_trained_on(tmp_path):
    """Two runs from the same weights on batches of other shapes save the same names, dtypes and sizes; a trainer
    that loads either one trains a shape neither run saw on one graph."""
    g = torch.Generator().manual_seed(7)
    states = []
    for shapes in ([(4, 8), (2, 5)], [(1, 12)]):
        torch.manual_seed(0)
        trainer = _trainer(GPT2(), optim.AdamConfig(lr=1e-2))
        for rows, length in shapes:
            trainer.train_step(*_batch(rows, length, g))
        trainer.save_checkpoint(tmp_path / f"{len(shapes)}.ortcp")
        states.append(trainer.state_dict())
    layout = [
        {k: (v.dtype, tuple(v.shape)) for k, v in state["optimizer"].items() if isinstance(v, torch.Tensor)}
        | {k: (v.dtype, tuple(v.shape)) for k, v in state["model"]["full_precision"].items()}
        for state in states
    ]
    assert layout[0] == layout[1]
    torch.manual_seed(1)
    resumed = _trainer(GPT2(), optim.AdamConfig(lr=1e-2))
    resumed.load_checkpoint(tmp_path / "1.ortcp")
    for rows, length in [(3, 10), (2, 4)]:
        assert torch.isfinite(resumed.train_step(*_batch(rows, length, g)))
    assert resumed.train_step_info.step == 3
