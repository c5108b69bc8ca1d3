"""Wrapped modules (activation checkpointing, torch.compile, DDP) train exactly like the plain module.

Parameter names are canonical everywhere (torch's `get_state_dict` names): wrapper prefixes such as
``module.`` (DDP), ``_orig_mod.`` (torch.compile) and ``_checkpoint_wrapped_module.`` are stripped
when parameters are discovered, exported and loaded.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

from ort_trainer import ORTTrainer, optim
from tests.models import MLP, MLP_DESC, mlp_batches
from tests.trees import assert_trees_equal

ce = torch.nn.functional.cross_entropy
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def _trainer(model):
    config = optim.AdamConfig(lr=0.05, lambda_coef=0.01)
    return ORTTrainer(model, MLP_DESC, config, loss_fn=ce, options={"utils": {"grad_norm_clip": False}})


def _run(model, steps: int = 5):
    trainer = _trainer(model)
    losses = [trainer.train_step(*batch).item() for batch in mlp_batches(steps)]
    return trainer, losses


@pytest.fixture(scope="module")
def plain():
    torch.manual_seed(0)
    model = MLP()
    trainer, losses = _run(copy.deepcopy(model))
    return model, trainer, losses


@pytest.fixture
def process_group():
    """DDP needs a process group: a world of one over gloo on 127.0.0.1, torn down afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _assert_same_run(plain, trainer, losses):
    _, reference, expected_losses = plain
    assert losses == expected_losses
    assert list(trainer.state_dict(pytorch_format=True)) == list(reference.state_dict(pytorch_format=True))
    assert_trees_equal(trainer.state_dict(), reference.state_dict())


def test_activation_checkpoint_wrapped_submodule_is_trained(plain):
    model = copy.deepcopy(plain[0])
    model.fc1 = checkpoint_wrapper(model.fc1)
    trainer, losses = _run(model)
    assert sorted(trainer.state_dict()["optimizer"]) == sorted(NAMES)
    _assert_same_run(plain, trainer, losses)
    model.load_state_dict(trainer.state_dict(pytorch_format=True), strict=True)  # the wrapper adds its prefix back


def test_compiled_module_trains_like_the_plain_module(plain):
    trainer, losses = _run(torch.compile(copy.deepcopy(plain[0])))
    _assert_same_run(plain, trainer, losses)


def test_ddp_wrapped_module_exports_canonical_names(plain, process_group):
    model = DDP(copy.deepcopy(plain[0]))
    trainer, losses = _run(model)
    assert list(trainer.state_dict(pytorch_format=True)) == NAMES
    _assert_same_run(plain, trainer, losses)


def test_compiled_ddp_with_checkpointed_submodule(plain, process_group):
    inner = copy.deepcopy(plain[0])
    inner.fc2 = checkpoint_wrapper(inner.fc2)
    trainer, losses = _run(torch.compile(DDP(inner)))
    _assert_same_run(plain, trainer, losses)


def test_state_dicts_of_wrapped_modules_load_under_canonical_names(process_group):
    torch.manual_seed(3)
    source = MLP()
    wrapped = copy.deepcopy(source)
    wrapped.fc1 = checkpoint_wrapper(wrapped.fc1)
    variants = {
        "ddp": DDP(copy.deepcopy(source)).state_dict(),
        "compiled": torch.compile(copy.deepcopy(source)).state_dict(),
        "compiled ddp": torch.compile(DDP(copy.deepcopy(source))).state_dict(),
        "checkpoint wrapper (named_parameters)": {n: p.detach() for n, p in wrapped.named_parameters()},
    }
    for label, state in variants.items():
        assert set(state) != set(NAMES), label  # the variants really carry wrapper prefixes
        for strict in (True, False):
            torch.manual_seed(0)
            trainer = _trainer(MLP())
            result = trainer.load_state_dict(state, strict=strict)
            assert (result.missing_keys, result.unexpected_keys) == ([], []), label
            assert_trees_equal(trainer.state_dict(pytorch_format=True), source.state_dict(), label)


def test_a_collision_after_stripping_prefixes_names_both_keys():
    state = MLP().state_dict()
    state["module.fc1.weight"] = state["fc1.weight"].clone()
    trainer = _trainer(MLP())
    before = trainer.state_dict()
    with pytest.raises(KeyError, match=r"'module.fc1.weight' and 'fc1.weight' both name parameter 'fc1.weight'"):
        trainer.load_state_dict(state, strict=False)
    assert_trees_equal(trainer.state_dict(), before)


def test_a_submodule_really_named_module_keeps_its_name():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = MLP()

        def forward(self, x):
            return self.module(x)

    torch.manual_seed(0)
    model = Outer()
    trainer = _trainer(model)
    assert list(trainer.state_dict(pytorch_format=True)) == [f"module.{n}" for n in NAMES]
    other = Outer()
    trainer.load_state_dict(other.state_dict())
    assert_trees_equal(trainer.state_dict(pytorch_format=True), other.state_dict())
    trainer.train_step(*mlp_batches(1)[0])
    model.load_state_dict(trainer.state_dict(pytorch_format=True), strict=True)
