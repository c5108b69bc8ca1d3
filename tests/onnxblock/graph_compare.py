"""ORT vs torch loss and gradients for the graph-rewrite tests."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_trainer.config.model_desc import validate_model_desc
from ort_trainer.engine.onnxblock._graphs import build_training_graphs
from ort_trainer.graph._weightless import checkable
from ort_trainer.graph.onnxblock._export import export_torch_model
from ort_trainer.graph.onnxblock._passes import add_optional_outputs


def ort_loss_and_grads(model, loss_fn, desc, batch, rewrite, train_rewrite=None):
    """Export like ORTTrainer does, optionally rewrite, build the gradient graph (rewrite it too), run it once.

    ``changed`` counts the nodes both rewrites replaced.
    """
    desc = validate_model_desc(desc, require_loss=True)
    exported = export_torch_model(copy.deepcopy(model), loss_fn, desc, batch, 17)
    forward = exported.model
    changed = rewrite(forward) if rewrite else 0
    onnx.checker.check_model(checkable(forward))
    add_optional_outputs(forward)
    params = [n for n in dict.fromkeys(exported.fqn_to_onnx.values()) if n not in exported.buffers]
    train, _ = build_training_graphs(forward, params, [], list(desc.output_names))
    changed += train_rewrite(train) if train_rewrite else 0
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(train.SerializeToString(), options, ["CPUExecutionProvider"])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    feeds = {name: t.numpy() for name, t in zip(desc.input_names, batch, strict=True)}
    feeds.update({p: state[p] for p in params})
    buffers = {p: np.zeros_like(state[p]) for p in params}  # InPlaceAccumulatorV2 writes into these
    feeds.update({f"{p}_grad.accumulation.buffer": buffer for p, buffer in buffers.items()})
    feeds["lazy_reset_grad"] = np.array([True])
    names = [o.name for o in session.get_outputs()]  # every output, or the accumulators do not run
    out = dict(zip(names, session.run(names, feeds), strict=True))
    grads = {p: torch.from_numpy(buffer) for p, buffer in buffers.items()}
    return float(out[desc.output_names[0]]), grads, changed


def torch_loss_and_grads(model, loss_fn, batch):
    model = copy.deepcopy(model)
    *inputs, label = batch
    loss = loss_fn(model(*inputs), label)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def assert_close(ort_result, torch_result, rtol=1e-5):
    (loss, grads), (expected_loss, expected) = ort_result, torch_result
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        scale = expected[name].abs().max().item()
        error = (grad - expected[name]).abs().max().item()
        assert error <= rtol * scale + 1e-9, f"{name}: max error {error:.3g} vs max |grad| {scale:.3g}"
