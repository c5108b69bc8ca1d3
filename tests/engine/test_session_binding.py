"""Output binding: what a step hands out is fresh memory that later steps never overwrite."""

from __future__ import annotations

import copy

import torch

from ort_trainer import ORTTrainer, optim
from tests.models import MLP, MLP_DESC, mlp_batches

ce = torch.nn.functional.cross_entropy
DESC = {"inputs": MLP_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", 4])]}


def test_returned_outputs_survive_later_steps_of_other_batch_sizes():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.0), loss_fn=ce)  # lr 0: outputs stay comparable
    batches = [mlp_batches(1, batch=n, seed=n)[0] for n in (8, 3, 8, 5)]
    kept = [trainer.train_step(*batch) for batch in batches] + [trainer.eval_step(*batch) for batch in batches]
    for (loss, logits), (x, label) in zip(kept, batches + batches, strict=True):
        expected = reference(x).detach()
        torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(loss, ce(expected, label), atol=1e-6, rtol=1e-5)
    assert len({loss.data_ptr() for loss, _ in kept}) == len(kept)  # no two steps share a buffer
