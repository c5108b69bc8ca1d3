"""Multi-process data parallel and ZeRO (gloo on 127.0.0.1), against one process on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ort_trainer import checkpoint
from tests.dist_runs import assert_full_state_equal, launch, single_process
from tests.dist_worker import make_trainer
from tests.models import mlp_batches
from tests.ranks import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference():
    return single_process()


@pytest.fixture(scope="module")
def zero1_set(tmp_path_factory):
    """Two ZeRO-1 ranks that train 8 steps and save a checkpoint set at the end: the (2, 1) case of the data-parallel
    test compares their states (a save after the last step changes none of them), the set test their files."""
    folder = tmp_path_factory.mktemp("zero1_set")
    path = folder / "ckpt.ortcp"
    return launch(2, folder / "run", "--zero", 1, "--save", path), path


@pytest.mark.processes
@pytest.mark.parametrize(("world", "zero"), [(2, 0), (2, 1), (3, 2)])
def test_data_parallel_and_zero_match_one_process_on_the_whole_batch(tmp_path, reference, world, zero, request):
    trainer, losses = reference
    ranks = (
        request.getfixturevalue("zero1_set")[0] if (world, zero) == (2, 1) else launch(world, tmp_path, "--zero", zero)
    )
    expected = trainer.state_dict(pytorch_format=True)
    for state in ranks:  # every rank holds the same full weights, equal to the single-process run
        for name, value in expected.items():
            torch.testing.assert_close(state["weights"][name], value, atol=2e-6, rtol=1e-5)
        assert state["train_step_info"] == {"optimization_step": 4, "step": 8, "seed": 100}  # rank 0's seed
    # per-rank losses average to the whole-batch loss (equal shard sizes)
    mean_loss = torch.stack([s["losses"] for s in ranks]).mean(0)
    torch.testing.assert_close(mean_loss, torch.tensor(losses), atol=1e-5, rtol=1e-5)
    total = sum(p.numel() for p in trainer.state_dict(pytorch_format=True).values()) * 2  # two moments
    numel = [s["optimizer_numel"] for s in ranks]
    if zero:
        assert sum(numel) == total and max(numel) <= total / world + 96 * 2, numel  # ~1/W of the moments each
    else:
        assert numel == [total] * world


@pytest.mark.processes
def test_zero_checkpoint_set_aggregates_to_the_single_process_state(zero1_set, reference):
    trainer, _ = reference
    path = zero1_set[1]
    tmp_path = path.parent
    manifest = checkpoint.manifest_path(path)
    files = checkpoint.check_manifest(manifest).rank_paths()  # present, with the sizes and CRC-32s each rank reported
    run_id = checkpoint.read_manifest(manifest).run_id
    assert [p.name for p in files] == [f"ckpt.rank{r}-of-2.{run_id[:8]}.ortcp" for r in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        [manifest.name, *(p.name for p in files)]
    )
    rank0 = checkpoint.load(files[0])
    assert rank0["trainer_options"]["zero_stage"] == 1 and rank0["trainer_options"]["world_size"] == 2
    assert rank0["partition_info"]["fc1.weight"]["megatron_row_partition"] == [-1]  # fc1.weight straddles ranks
    full = checkpoint.aggregate_checkpoints(manifest)
    assert_full_state_equal(full, trainer.state_dict())
    with pytest.raises(checkpoint.CheckpointError, match="rank"):
        checkpoint.aggregate_checkpoints([files[0]])
    assert checkpoint.aggregate_checkpoints([manifest])["train_step_info"] == full["train_step_info"]  # list of one


@pytest.mark.processes
@pytest.mark.faults  # 2 processes, 4 background saves: `make test-faults` (the manager test below runs async sets)
def test_async_saves_during_training_publish_complete_sets_and_replace_the_old_ones(tmp_path, reference):
    trainer, losses = reference
    path = tmp_path / "ckpt.ortcp"
    ranks = launch(
        2, tmp_path / "run", "--zero", 1, "--save-every", 2, "--async-save", "--overwrite", "--save", path
    )  # saves at steps 2, 4, 6 (in the background while training goes on) and 8; the last one at exit
    mean_loss = torch.stack([s["losses"] for s in ranks]).mean(0)
    torch.testing.assert_close(mean_loss, torch.tensor(losses), atol=1e-5, rtol=1e-5)  # training undisturbed
    manifest = checkpoint.check_manifest(checkpoint.manifest_path(path))
    assert manifest.step == 8
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        [manifest.path.name, *(e.name for e in manifest.files)]
    )  # the sets of steps 2, 4 and 6 were removed once the next one was published
    assert_full_state_equal(checkpoint.aggregate_checkpoints(manifest.path), trainer.state_dict())


@pytest.mark.processes
def test_checkpoint_manager_on_two_ranks_resumes_the_latest_set(tmp_path, reference):
    trainer, losses = reference
    run = tmp_path / "ckpts"
    launch(2, tmp_path / "first", "--zero", 1, "--stop", 5, "--save-every", 2, "--async-save", "--manager", run)
    assert sorted(p.name for p in run.iterdir() if not p.name.endswith(".ortcp")) == [
        "ckpt-000000004.ortcp.manifest.json",
        "ort_trainer_checkpoints.json",
    ]  # keep_last=1: the set of step 2 was pruned once step 4's was published
    ranks = launch(2, tmp_path / "second", "--zero", 1, "--save-every", 2, "--manager", run)  # restores step 4
    mean_loss = torch.stack([s["losses"] for s in ranks]).mean(0)
    torch.testing.assert_close(mean_loss, torch.tensor(losses[4:]), atol=1e-5, rtol=1e-5)
    for state in ranks:
        assert state["train_step_info"] == {"optimization_step": 4, "step": 8, "seed": 100}  # rank 0's seed
    latest = checkpoint.CheckpointManager(run).latest()
    assert latest.step == 8 and latest.path.endswith("ckpt-000000008.ortcp.manifest.json")
    assert_full_state_equal(checkpoint.aggregate_checkpoints(latest.path), trainer.state_dict())
    assert len(list(run.glob("*.ortcp"))) == 2  # the two rank files of step 8


@pytest.mark.processes
@pytest.mark.parametrize(("before", "after"), [((2, 1), (3, 2)), ((3, 2), (2, 1))])
def test_reshard_and_continue_matches_uninterrupted_training(tmp_path, reference, before, after):
    trainer, _ = reference
    path = tmp_path / "half.ortcp"
    launch(before[0], tmp_path / "first", "--zero", before[1], "--stop", 4, "--save", path)
    ranks = launch(
        after[0], tmp_path / "second", "--zero", after[1], "--start", 4, "--load", checkpoint.manifest_path(path)
    )
    for state in ranks:
        assert state["train_step_info"] == {"optimization_step": 4, "step": 8, "seed": 100}  # rank 0's seed
        for name, value in trainer.state_dict(pytorch_format=True).items():
            torch.testing.assert_close(state["weights"][name], value, atol=2e-6, rtol=1e-5)


@pytest.mark.processes
def test_reshard_two_ranks_to_one_process(tmp_path, reference):
    trainer, _ = reference
    path = tmp_path / "half.ortcp"
    launch(2, tmp_path / "first", "--zero", 2, "--stop", 4, "--save", path)
    single = make_trainer(0, True)
    single.load_checkpoint(checkpoint.manifest_path(path))
    for batch in mlp_batches(8, batch=12)[4:]:
        single.train_step(*batch)
    assert_full_state_equal(single.state_dict(), trainer.state_dict())


def test_options_that_contradict_the_existing_process_group_are_rejected():
    import torch.distributed as dist

    from ort_trainer import ORTTrainer, optim
    from tests.models import MLP, MLP_DESC

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError, match="world_rank=1, world_size=2, but the existing default process group has rank 0 of 1"
        ):
            ORTTrainer(
                MLP(),
                MLP_DESC,
                optim.AdamConfig(),
                loss_fn=torch.nn.functional.cross_entropy,
                options={"distributed": {"world_size": 2, "world_rank": 1}},
            )
    finally:
        dist.destroy_process_group()


def test_missing_rendezvous_environment_is_a_clear_error(monkeypatch):
    from ort_trainer import ORTTrainer, optim
    from tests.models import MLP, MLP_DESC

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        ORTTrainer(
            MLP(),
            MLP_DESC,
            optim.AdamConfig(),
            loss_fn=torch.nn.functional.cross_entropy,
            options={"distributed": {"world_size": 2, "world_rank": 0}},
        )


@pytest.mark.processes
def test_legacy_per_rank_paths_each_rank_writes_exactly_its_file(tmp_path, reference):
    """issue 10.3: `save_checkpoint(f"ckpt_rank{rank}.ortcp")` on every rank, then aggregate / load all the files."""
    trainer, _ = reference
    launch(2, tmp_path / "run", "--zero", 1, "--save-every", 4, "--save", tmp_path / "ck_s{step}_r{rank}.ortcp")
    written = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert written == ["ck_s4_r0.ortcp", "ck_s4_r1.ortcp", "ck_s8_r0.ortcp", "ck_s8_r1.ortcp"]  # no manifest, no temp
    final = [tmp_path / "ck_s8_r1.ortcp", tmp_path / "ck_s8_r0.ortcp"]
    assert_full_state_equal(checkpoint.aggregate_checkpoints(final), trainer.state_dict())
    # the files describe themselves: rank, world size, ZeRO stage, step and the save's run id
    metas = [checkpoint.load(p, key="trainer_options") for p in final]
    assert [(m["world_rank"], m["world_size"], m["zero_stage"]) for m in metas] == [(1, 2, 1), (0, 2, 1)]
    run_ids = {p.name: checkpoint.load(p, key="distributed/run_id") for p in tmp_path.glob("*.ortcp")}
    assert run_ids["ck_s8_r0.ortcp"] == run_ids["ck_s8_r1.ortcp"] != run_ids["ck_s4_r0.ortcp"]
    with pytest.raises(checkpoint.AggregationError, match=r"missing rank\(s\) \[1\]"):
        checkpoint.aggregate_checkpoints([tmp_path / "ck_s8_r0.ortcp"])
    with pytest.raises(checkpoint.AggregationError, match="run_id differs"):
        checkpoint.aggregate_checkpoints([tmp_path / "ck_s4_r0.ortcp", tmp_path / "ck_s8_r1.ortcp"])
    with pytest.raises(checkpoint.AggregationError, match="rank 0 appears 2 times"):
        checkpoint.aggregate_checkpoints([*final, tmp_path / "ck_s4_r0.ortcp"])
    single = make_trainer(0, True)  # the legacy load: every rank file, into any world size
    single.load_checkpoint(*final)
    single.train_step(*mlp_batches(1, batch=12)[0])  # the loaded state is applied when the graphs are built
    assert single.train_step_info.step == 9


@pytest.mark.processes
def test_bad_distributed_saves_fail_on_every_rank_without_hanging(tmp_path):
    path = tmp_path / "ck.ortcp"
    launch(2, tmp_path / "b", "--stop", 2, "--save", path)
    launch(2, tmp_path / "c", "--stop", 2, "--save", path, "--expect-save-error", "already exists")


def test_init_process_group_refuses_bad_input(monkeypatch):
    import ort_trainer

    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        ort_trainer.init_process_group("mpi")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        ort_trainer.init_process_group("gloo")


def test_torchrun_store_handshake_ignores_the_keys_of_a_killed_incarnation(monkeypatch):
    """torchrun's agent store keeps the keys of the incarnation a restart replaced (issue S item 8): the ranks of
    the new one must agree on a fresh namespace whatever they find there, whichever rank comes first."""
    import threading
    import time

    import torch.distributed as dist

    from ort_trainer.engine import _distributed

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    root = "ort_trainer/incarnation"
    for key, value in [("join/1", "old"), ("ack/1", "old:oldtoken"), ("confirm/1", "old:oldtoken")]:
        server.set(f"{root}/{key}", value)  # what the killed incarnation left
    for first in (0, 1):
        stores, errors = {}, []

        def rank(r, delay, stores=stores, errors=errors):
            time.sleep(delay)
            try:
                stores[r] = _distributed._incarnation_store(r, 2, timeout_s=30)
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r, 0.0 if r == first else 0.3)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and set(stores) == {0, 1}, errors
        stores[0].set("probe", f"first={first}")
        assert stores[1].get("probe") == f"first={first}".encode()  # one namespace...
        assert not server.check(["ort_trainer/oldtoken/probe"])  # ...not the killed incarnation's
        assert server.get(f"{root}/confirm/1").decode().split(":")[1] != "oldtoken"


def test_torchrun_store_handshake_without_rank_0_is_a_clear_error(monkeypatch):
    import torch.distributed as dist

    from ort_trainer.engine import _distributed

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(RuntimeError, match="did not meet within"):
        _distributed._incarnation_store(1, 2, timeout_s=0.5)
