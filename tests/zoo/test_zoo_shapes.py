"""The zoo at varying shapes: every batch its own batch size and (padded) lengths, as a collator pads each batch to its
longest example and an epoch ends in a smaller batch. The autograd engine serves them all from one symbolic graph
(the dims ``model_desc`` names: batch, seq, target) and trains equal to eager PyTorch at every shape (issue V).
Run by ``make test-zoo``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.zoo.architectures import ARCHITECTURES, Architecture
from tests.zoo.test_zoo import AUTOGRAD_REFUSED, AUTOGRAD_WEIGHT_ATOL, _torch_losses, _trainer

pytestmark = pytest.mark.zoo

# each step's size of each named dim: batches of 2, 3 and 1 rows (an epoch's last), lengths up and down
SIZES = {"batch": [2, 3, 1, 2, 3], "seq": [8, 6, 5, 7, 8], "target": [6, 5, 4, 3, 6]}
# families whose code makes a named dim static: one graph per size of it (said once, with the line); none today
PER_SHAPE: dict[str, str] = {}


def _resized(tensor: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """``tensor`` with ``size`` entries along ``axis``: its own rows repeated, then cut (ids and labels stay valid;
    a cut sequence loses its padding tail, so some batches are padded and some are not)."""
    repeats = -(-size // tensor.shape[axis])
    return torch.cat([tensor] * repeats, dim=axis).narrow(axis, 0, size)


def varied_batches(arch: Architecture, g: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    batches = []
    for step in range(len(SIZES["batch"])):
        batch = []
        for (_, dims), tensor in zip(arch.inputs, arch.batch(g), strict=True):
            for axis, dim in enumerate(dims):
                if isinstance(dim, str):
                    tensor = _resized(tensor, axis, SIZES[dim][step])
            batch.append(tensor)
        batches.append(tuple(batch))
    return batches


@pytest.mark.parametrize("name", sorted(set(ARCHITECTURES) - set(AUTOGRAD_REFUSED)))
def test_one_symbolic_graph_trains_like_torch_at_every_shape(name, caplog):
    arch = ARCHITECTURES[name]()
    batches = varied_batches(arch, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = arch.build()
    reference = copy.deepcopy(model)
    trainer = _trainer(model, arch, "autograd")
    caplog.set_level(logging.INFO, logger="ort_trainer")
    losses = [trainer.train_step(*batch).item() for batch in batches]
    expected = _torch_losses(reference, arch, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    weights = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        if key in weights:
            atol = AUTOGRAD_WEIGHT_ATOL.get(name, 1e-5)
            torch.testing.assert_close(weights[key], value, atol=atol, rtol=1e-4, msg=f"{name}: {key}")
    reference.eval()
    names = [n for n, _ in arch.inputs]
    for batch in batches[:3]:  # eval batches of other sizes: one eval graph too
        with torch.no_grad():
            want = reference(**dict(zip(names, batch, strict=True)))[0]
        torch.testing.assert_close(trainer.eval_step(*batch), want, atol=1e-5, rtol=1e-5)
    shapes = {tuple(tuple(t.shape) for t in batch) for batch in batches}
    builds = caplog.text.count("new input shapes")
    if name in PER_SHAPE:
        assert builds == len(shapes) - 1
    else:
        assert builds == 0, f"{name}: {builds} graphs built after the first for {len(shapes)} shapes"
