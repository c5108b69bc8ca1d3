"""The round trip: an MLP exported by ``export_training`` trains 10 AdamW steps in onnxruntime-node, the JS driver
saves its state, and Python takes it back three ways: ``load_training_state`` into an ``ORTTrainer``,
``ort-trainer-ckpt convert`` to a checkpoint for ``ORTTrainer.load_checkpoint``, and ``module_state_dict`` into the
plain PyTorch module. The trainers then train 10 more steps: equal to 20 steps of an ORTTrainer that never left
Python (the node steps are bit-equal to the Python driver; the driver's graph and ORTTrainer's agree within ~2e-7)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, export_training, load_training_state, optim
from tests.js.runners import run_js, write_plan
from tests.models import MLP, MLP_DESC

STEPS, HALF, LR = 20, 10, 1e-2
TOLERANCE = 1e-5  # two graphs (the artifact's, ORTTrainer's) of the same step; seen: ~1e-7


def _trainer() -> ORTTrainer:
    torch.manual_seed(0)
    config = optim.AdamConfig(lr=LR, weight_decay=0.01)
    return ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    sizes = (8, 5, 3, 8)
    return [(torch.randn(sizes[i % 4], 20, generator=g), torch.randint(0, 4, (sizes[i % 4],), generator=g))
            for i in range(STEPS + 1)]  # fmt: skip


@pytest.fixture(scope="module")
def trained_in_node(tmp_path_factory):
    """(the batches, the never-left-Python run's losses, its weights at HALF and at the end, the artifact, the
    state node saved after HALF steps)."""
    root = tmp_path_factory.mktemp("round_trip")
    batches = _batches()
    straight = _trainer()
    losses, halfway = [], None
    for i, batch in enumerate(batches[:STEPS]):
        losses.append(straight.train_step(*batch).item())
        if i + 1 == HALF:
            halfway = {k: v.clone() for k, v in straight.state_dict(pytorch_format=True).items()}
    final = straight.state_dict(pytorch_format=True)
    artifact = export_training(_trainer(), root / "artifact", inputs=batches[0])
    numpy_batches = [{"x": x.numpy(), "label": label.numpy()} for x, label in batches[:HALF]]
    plan = write_plan(root / "plan", numpy_batches, [LR] * HALF, None)
    result, _ = run_js("node", artifact, plan, root / "node")
    np.testing.assert_allclose(result["losses"], losses[:HALF], rtol=0, atol=TOLERANCE)
    return batches, losses, halfway, final, artifact, root / "node" / "state.safetensors"


def _continue(trainer: ORTTrainer, batches, losses, final) -> float:
    """Train the second half; assert it equal to the straight run's; returns the largest difference."""
    assert trainer.train_step_info.optimization_step == HALF
    rest = [trainer.train_step(*batch).item() for batch in batches[HALF:STEPS]]
    np.testing.assert_allclose(rest, losses[HALF:], rtol=0, atol=TOLERANCE)
    worst = float(np.abs(np.array(rest) - losses[HALF:]).max())
    for name, value in trainer.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=TOLERANCE, msg=name)
        worst = max(worst, float((value - final[name]).abs().max()))
    return worst


def test_load_training_state_into_an_ortrainer_continues_as_if_it_never_left_python(trained_in_node, record_property):
    batches, losses, _, final, artifact, saved = trained_in_node
    state = load_training_state(artifact, state=saved)
    assert state.step == HALF and state.optimizer == "AdamOptimizer"
    trainer = _trainer()
    trainer.load_state_dict(state.trainer_state_dict())
    record_property("max_difference", _continue(trainer, batches, losses, final))


def test_ort_trainer_ckpt_convert_then_load_checkpoint_continues_as_if_it_never_left_python(
    trained_in_node, tmp_path, record_property
):
    batches, losses, _, final, _, saved = trained_in_node
    checkpoint = tmp_path / "from_node.ortcp"
    cli = [sys.executable, "-m", "ort_trainer.checkpoint", "convert", str(saved), "-o", str(checkpoint)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"update count {HALF}" in done.stdout, done.stdout
    trainer = _trainer()
    trainer.load_checkpoint(checkpoint)
    record_property("max_difference", _continue(trainer, batches, losses, final))


def test_the_plain_pytorch_module_gets_the_weights_node_trained(trained_in_node):
    batches, _, halfway, _, artifact, saved = trained_in_node
    module = MLP()
    module.load_state_dict(load_training_state(artifact, state=saved).module_state_dict(module), strict=True)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, halfway[name], rtol=0, atol=TOLERANCE, msg=name)
    x, label = batches[STEPS]
    with torch.no_grad():
        reference = MLP()
        reference.load_state_dict(halfway)
        expected = torch.nn.functional.cross_entropy(reference(x), label)
        torch.testing.assert_close(torch.nn.functional.cross_entropy(module(x), label), expected, rtol=0, atol=1e-5)
