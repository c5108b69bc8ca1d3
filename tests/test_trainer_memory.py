"""Memory a built trainer holds: no second copy of the weights next to its flat buffers."""

from __future__ import annotations

import copy

import torch

from ort_trainer import ORTTrainer, optim
from tests.models import CNN, CNN_DESC, cnn_batches

ce = torch.nn.functional.cross_entropy


def test_built_trainer_keeps_no_copy_of_the_initial_weights():
    torch.manual_seed(0)
    model = CNN()  # weights, BatchNorm running stats (float buffers) and num_batches_tracked (int)
    trainer = ORTTrainer(copy.deepcopy(model), CNN_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    held = trainer._initial_state
    assert held["conv.weight"].device.type == "cpu"  # before the build: the values are needed
    for batch in cnn_batches(2):
        trainer.train_step(*batch)
    floats = {fqn: t for fqn, t in trainer._initial_state.items() if t.is_floating_point()}
    assert floats and all(t.device.type == "meta" for t in floats.values())
    assert trainer._initial_state["bn.num_batches_tracked"].device.type == "cpu"
    state = trainer.state_dict(pytorch_format=True)
    assert {k: (v.dtype, v.shape) for k, v in state.items()} == {
        k: (v.dtype, v.shape) for k, v in model.state_dict().items()
    }
    assert int(state["bn.num_batches_tracked"]) == 2
    fresh = CNN()
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(fresh.bn.running_mean, state["bn.running_mean"])
