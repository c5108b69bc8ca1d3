"""A process group that ort_trainer created is torn down cleanly: by ``close()`` or at interpreter exit.

Left to interpreter finalization, gloo's worker threads abort the process ("terminate called without an
active exception", SIGABRT) in a fraction of rank exits; the many-run check is in test_teardown_faults.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ort_trainer import ORTTrainer, optim
from ort_trainer.engine._distributed import DistributedContext
from tests.dist_runs import launch
from tests.models import MLP, MLP_DESC, mlp_batches
from tests.ranks import free_port


@pytest.mark.processes
def test_two_rank_zero_run_exits_with_the_group_destroyed_by_the_exit_hook(tmp_path):
    """Like a legacy script, the worker never tears down: ort_trainer's exit hook does (trainer.close(): faults)."""
    report = tmp_path / "exit"
    launch(2, tmp_path / "out", "--zero", 1, "--stop", 2, "--save", tmp_path / "ck.ortcp", "--report-exit", report)
    for rank in range(2):
        assert (tmp_path / f"exit.rank{rank}").read_text() == "initialized=False", f"rank {rank}"


@pytest.fixture
def rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_last_holder_of_a_group_we_created_destroys_it(rendezvous):
    first = DistributedContext(0, 1, torch.device("cpu"))  # creates the group
    second = DistributedContext(0, 1, torch.device("cpu"))  # joins it
    first.close()
    assert dist.is_initialized()  # the second still uses it
    first.close()  # idempotent: does not count twice
    assert dist.is_initialized()
    second.close()
    assert not dist.is_initialized()


def test_a_group_the_user_created_is_never_destroyed(rendezvous):
    dist.init_process_group("gloo", rank=0, world_size=1)
    context = DistributedContext(0, 1, torch.device("cpu"))
    context.close()
    assert dist.is_initialized()


def test_a_closed_trainer_refuses_steps_but_keeps_its_state():
    trainer = ORTTrainer(MLP(), MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy)
    batch = mlp_batches(1)[0]
    trainer.train_step(*batch)
    weights = trainer.state_dict(pytorch_format=True)
    trainer.close()
    trainer.close()
    with pytest.raises(RuntimeError, match=r"train_step: this trainer was closed \(ORTTrainer.close\(\)\)"):
        trainer.train_step(*batch)
    for name, value in trainer.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(value, weights[name])


def test_a_with_block_closes_the_trainer_after_publishing_its_pending_save(tmp_path):
    """``with ORTTrainer(...) as trainer:``: at the end of the block the asynchronous save is published and the
    trainer is closed (`close`; its process-group part is the tests' above)."""
    model = MLP()
    batch = mlp_batches(1)[0]
    with ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy) as trainer:
        trainer.train_step(*batch)
        handle = trainer.save_checkpoint(tmp_path / "ck.ortcp", async_save=True)
    assert handle.done() and (tmp_path / "ck.ortcp").is_file()
    with pytest.raises(RuntimeError, match=r"this trainer was closed"):
        trainer.train_step(*batch)
