"""`gradients_as_outputs`: gradients leave the training graph as outputs, equal to PyTorch's gradients.

The session binds them to the trainer's gradient buffers, so ONNX Runtime's kernels write them in place
(no ``InPlaceAccumulatorV2`` copy); accumulation steps add ORT-allocated gradients into the buffers.
"""

from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.engine._session import build_training_graphs
from ort_trainer.graph import ACCUMULATOR_SUFFIX, gradients_as_outputs
from ort_trainer.graph._export import export_torch_model
from ort_trainer.graph._passes import add_optional_outputs
from ort_trainer.model_desc import validate_model_desc
from tests.models import LM_DESC, TinyLM, lm_batches, lm_loss
from tests.test_graph_rewrites import _assert_close, _torch_loss_and_grads


def _lm():
    torch.manual_seed(0)
    return TinyLM(vocab=64, d_model=16, layers=2, heads=2)


def _training_graph(model, batch):
    desc = validate_model_desc(LM_DESC, require_loss=True)
    exported = export_torch_model(copy.deepcopy(model), lm_loss, desc, batch, 17)
    add_optional_outputs(exported.model)
    params = [n for n in dict.fromkeys(exported.fqn_to_onnx.values()) if n not in exported.buffers]
    train, _ = build_training_graphs(exported.model, params, [], list(desc.output_names))
    return train, params, desc


def test_graph_outputs_are_the_gradients_torch_computes():
    model, batch = _lm(), lm_batches(1, batch=3, seq=10, vocab=64)[0]
    train, params, desc = _training_graph(model, batch)
    removed = gradients_as_outputs(train)
    assert removed == {f"{p}_grad{ACCUMULATOR_SUFFIX}": f"{p}_grad" for p in params}
    assert "InPlaceAccumulatorV2" not in {node.op_type for node in train.graph.node}
    inputs = {i.name for i in train.graph.input}
    assert "lazy_reset_grad" not in inputs and not any(name.endswith(ACCUMULATOR_SUFFIX) for name in inputs)
    assert gradients_as_outputs(train) == {}  # nothing left to rewrite
    session = ort.InferenceSession(train.SerializeToString(), providers=["CPUExecutionProvider"])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    feeds = {name: t.numpy() for name, t in zip(desc.input_names, batch, strict=True)}
    feeds.update({p: state[p] for p in params})
    names = [desc.output_names[0]] + [f"{p}_grad" for p in params]
    loss, *grads = session.run(names, feeds)
    got = (float(loss), {p: torch.from_numpy(np.asarray(g)) for p, g in zip(params, grads, strict=True)})
    _assert_close(got, _torch_loss_and_grads(model, lm_loss, batch))


def _sgd_trainer(model, accumulation):
    options = {"utils": {"grad_norm_clip": False}, "batch": {"gradient_accumulation_steps": accumulation}}
    return ORTTrainer(copy.deepcopy(model), LM_DESC, optim.SGDConfig(lr=1.0), loss_fn=lm_loss, options=options)


def _assert_step_is_minus_gradient(trainer, before, expected_grads, steps):
    after = trainer.state_dict(pytorch_format=True)
    for name, grad in expected_grads.items():
        step = before[name] - after[name]  # SGD, lr 1: the gradient (the mean over the accumulated steps)
        scale = grad.abs().max().item()
        error = (step - grad).abs().max().item()
        assert error <= 1e-5 * scale + 1e-7, f"{name} after {steps} steps: max error {error:.3g} vs {scale:.3g}"


def test_trainer_buffers_receive_torch_gradients_with_and_without_accumulation():
    model = _lm()
    batches = lm_batches(3, batch=3, seq=10, vocab=64)
    for accumulation in (1, 3):
        trainer = _sgd_trainer(model, accumulation)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        per_batch = [_torch_loss_and_grads(model, lm_loss, b)[1] for b in batches[:accumulation]]
        expected = {name: sum(g[name] for g in per_batch) / accumulation for name in per_batch[0]}
        for batch in batches[:accumulation]:
            trainer.train_step(*batch)
        _assert_step_is_minus_gradient(trainer, before, expected, accumulation)


def test_a_second_cycle_overwrites_the_accumulated_gradients():
    """Accumulate (add) then start a new cycle (overwrite): the second update uses only its own batches."""
    model = _lm()
    batches = lm_batches(4, batch=3, seq=10, vocab=64)
    trainer = _sgd_trainer(model, 2)
    for batch in batches[:2]:
        trainer.train_step(*batch)
    middle = trainer.state_dict(pytorch_format=True)
    reference = copy.deepcopy(model)
    reference.load_state_dict(middle)
    per_batch = [_torch_loss_and_grads(reference, lm_loss, b)[1] for b in batches[2:]]
    expected = {name: (per_batch[0][name] + per_batch[1][name]) / 2 for name in per_batch[0]}
    for batch in batches[2:]:
        trainer.train_step(*batch)
    _assert_step_is_minus_gradient(trainer, middle, expected, 4)
