"""Checkpoints behind fsspec URLs: a real S3 endpoint (moto's server on 127.0.0.1), memory://, and the errors.

The S3 server is started by the tests; credentials and endpoint reach s3fs the way a user's would, through
the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from ort_trainer import ORTTrainer, checkpoint
from ort_trainer.checkpoint.cli._main import main as cli
from tests.builders import mlp_trainer
from tests.models import mlp_batches
from tests.paths import REPO
from tests.ranks import free_port

BATCHES = mlp_batches(4)


@pytest.fixture(scope="module")
def s3():
    """A bucket on a local S3 server; yields (s3fs filesystem, bucket URL)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("bucket")
    try:
        yield fs, "s3://bucket"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def _same_state(a: ORTTrainer, b: ORTTrainer) -> bool:
    sa, sb = a.state_dict(pytorch_format=True), b.state_dict(pytorch_format=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_trainer_saves_and_loads_through_s3_sync_and_async(s3):
    fs, bucket = s3
    prefix = f"{bucket}/{uuid.uuid4().hex}"
    trainer = mlp_trainer(hidden=1024)
    trainer.train_step(*BATCHES[0])
    trainer.save_checkpoint(f"{prefix}/sync.ortcp", user_dict={"where": "s3"})
    handle = trainer.save_checkpoint(f"{prefix}/async.ortcp", async_save=True)
    trainer.train_step(*BATCHES[1])  # training goes on while the upload runs
    handle.wait()
    keys = sorted(k.rsplit("/", 1)[-1] for k in fs.ls(prefix.removeprefix("s3://"), refresh=True))
    assert keys == ["async.ortcp", "sync.ortcp"]  # the temporary keys were moved, none left behind
    with pytest.raises(checkpoint.CheckpointExistsError, match=r"s3://bucket/.*/sync\.ortcp already exists"):
        trainer.save_checkpoint(f"{prefix}/sync.ortcp")
    for name in ("sync", "async"):
        fresh = mlp_trainer(hidden=1024)
        user_dict = fresh.load_checkpoint(f"{prefix}/{name}.ortcp")
        assert user_dict == ({"where": "s3"} if name == "sync" else {})
        reference = mlp_trainer(hidden=1024)
        reference.train_step(*BATCHES[0])
        fresh.train_step(*BATCHES[1])
        reference.train_step(*BATCHES[1])
        assert _same_state(fresh, reference), name


def test_manager_keeps_and_restores_on_s3(s3):
    fs, bucket = s3
    run = f"{bucket}/{uuid.uuid4().hex}/run"
    manager = checkpoint.CheckpointManager(run, keep_last=1, async_save=True)
    trainer = mlp_trainer()
    for batch in BATCHES[:3]:
        trainer.train_step(*batch)
        manager.save(trainer, metrics={"loss": 1.0})
    manager.wait()
    names = sorted(k.rsplit("/", 1)[-1] for k in fs.ls(run.removeprefix("s3://"), refresh=True))
    assert names == ["ckpt-000000003.ortcp", "ort_trainer_checkpoints.json"]
    assert checkpoint.CheckpointManager(run).latest().step == 3
    fresh = mlp_trainer()
    assert checkpoint.CheckpointManager(run).restore(fresh).step == 3
    fresh.train_step(*BATCHES[3])
    trainer.train_step(*BATCHES[3])
    assert _same_state(fresh, trainer)


def test_cli_reads_and_writes_urls(s3, tmp_path, capsys):
    fs, bucket = s3
    prefix = f"{bucket}/{uuid.uuid4().hex}"
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    trainer.save_checkpoint(f"{prefix}/ckpt.ortcp")
    assert cli(["verify", f"{prefix}/ckpt.ortcp"]) == 0
    assert cli(["convert", f"{prefix}/ckpt.ortcp", "-o", f"{prefix}/model.safetensors"]) == 0
    assert f"uploaded {prefix}/model.safetensors" in capsys.readouterr().out
    assert cli(["convert", f"{prefix}/model.safetensors", "-o", str(tmp_path / "back.ortcp")]) == 0
    weights = checkpoint.load(tmp_path / "back.ortcp", key="model/full_precision")
    assert all(torch.equal(weights[k], v) for k, v in trainer.state_dict(pytorch_format=True).items())
    assert cli(["convert", f"{prefix}/ckpt.ortcp", "-o", f"{prefix}/model.safetensors"]) == 2  # exists
    assert "model.safetensors already exists" in capsys.readouterr().err


def test_missing_credentials_are_a_clear_error_naming_the_url(s3, monkeypatch):
    import s3fs

    _, bucket = s3
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    url = f"{bucket}/nocreds/ckpt.ortcp"
    try:
        with pytest.raises(checkpoint.CheckpointStorageError, match=rf"{url}: cannot .* no credentials"):
            trainer.save_checkpoint(url)
        with pytest.raises(checkpoint.CheckpointStorageError, match="no credentials"):
            trainer.load_checkpoint(url)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_memory_urls_and_unknown_schemes():
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    url = f"memory://ckpts/{uuid.uuid4().hex}/ckpt.ortcp"
    trainer.save_checkpoint(url)
    fresh = mlp_trainer()
    fresh.load_checkpoint(url)
    fresh.train_step(*BATCHES[1])
    trainer.train_step(*BATCHES[1])
    assert _same_state(fresh, trainer)
    with pytest.raises(
        checkpoint.CheckpointStorageError, match="no fsspec filesystem is known for the scheme 'nosuchfs://'"
    ):
        trainer.save_checkpoint("nosuchfs://bucket/ckpt.ortcp")
    with pytest.raises(
        checkpoint.CheckpointStorageError, match=r"gs://b/c\.ortcp: the fsspec filesystem for 'gs://' is not"
    ):
        trainer.load_checkpoint("gs://b/c.ortcp")


def test_a_third_backend_joins_by_registering_its_scheme(monkeypatch):
    """``register_scheme``: URLs of a new scheme resolve to the backend's ``Location`` (here a thin one over
    fsspec's memory store whose ``display`` keeps the user's URL); saves, loads and errors go through it."""
    from ort_trainer.checkpoint.io import _location

    made = []

    class Aliased(checkpoint.io.RemoteLocation):
        def __init__(self, url, storage_options=None, **kwargs):
            super().__init__(url.replace("vault://", "memory://vault/", 1), storage_options, **kwargs)
            made.append(url)

    monkeypatch.setitem(_location._SCHEMES, "vault", lambda url, options: Aliased(url, options))
    with pytest.raises(ValueError, match=r"a URL scheme is .*got 'x'"):
        checkpoint.io.register_scheme("x", Aliased)
    with pytest.raises(TypeError, match="factory must be a callable"):
        checkpoint.io.register_scheme("vault", None)
    location = checkpoint.io.resolve("vault://run/ckpt.ortcp")
    assert isinstance(location, checkpoint.io.Location) and isinstance(location, Aliased)
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    url = f"vault://{uuid.uuid4().hex}/ckpt.ortcp"
    trainer.save_checkpoint(url)
    with pytest.raises(checkpoint.CheckpointExistsError, match="already exists"):
        trainer.save_checkpoint(url, overwrite=False)
    fresh = mlp_trainer(seed=1)
    fresh.load_checkpoint(url)
    assert url in made and _same_state(fresh, trainer)


NO_FSSPEC = """
import sys
sys.modules["fsspec"] = None  # as if it were not installed: importing it raises ImportError
import torch
from ort_trainer import ORTTrainer, checkpoint, optim
from tests.models import MLP, MLP_DESC, mlp_batches
trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
trainer.train_step(*mlp_batches(1)[0])
trainer.save_checkpoint(sys.argv[1])
trainer.save_checkpoint("file://" + sys.argv[1] + ".2")
trainer.load_checkpoint(sys.argv[1])
try:
    trainer.save_checkpoint("s3://bucket/ckpt.ortcp")
except checkpoint.CheckpointStorageError as error:
    print(error)
"""


@pytest.mark.processes
def test_local_paths_need_no_fsspec(tmp_path):
    path = tmp_path / "local.ortcp"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NO_FSSPEC), str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert checkpoint.load(path, key="train_step_info")["step"] == 1
    assert (tmp_path / "local.ortcp.2").exists()
    assert "s3://bucket/ckpt.ortcp: URLs need the 'fsspec' package (pip install fsspec" in result.stdout


@pytest.mark.processes
@pytest.mark.faults  # two processes and ~20 S3 round trips: part of `make test-faults`
def test_distributed_async_set_on_s3_replaces_the_old_set_and_aggregates(s3, tmp_path):
    from tests.dist_runs import assert_full_state_equal, launch, single_process

    fs, bucket = s3
    prefix = f"{bucket}/{uuid.uuid4().hex}"
    url = f"{prefix}/ckpt.ortcp"
    launch(2, tmp_path / "run", "--zero", 1, "--save-every", 4, "--async-save", "--overwrite", "--save", url)
    names = sorted(k.rsplit("/", 1)[-1] for k in fs.ls(prefix.removeprefix("s3://"), refresh=True))
    manifest = fs.cat_file(f"{prefix.removeprefix('s3://')}/ckpt.ortcp.manifest.json").decode()
    listed = sorted(name for name in names if name in manifest)
    assert names == sorted(["ckpt.ortcp.manifest.json", *listed]) and len(listed) == 2, names  # step 4's set is gone
    reference, _ = single_process()
    with checkpoint.io.local_inputs(f"{url}.manifest.json") as local:  # the manifest and its files, downloaded
        assert_full_state_equal(checkpoint.aggregate_checkpoints(local), reference.state_dict())
    fresh = mlp_trainer()
    fresh.load_checkpoint(f"{url}.manifest.json")  # a single process loads the set straight from S3
    fresh.train_step(*mlp_batches(1, batch=12)[0])
    assert fresh.train_step_info.step == 9


# ---------------------------------------------------------------- faults (issue 24)
def test_glob_characters_in_an_s3_url_save_at_that_exact_key(s3):
    fs, bucket = s3
    run = f"{bucket}/{uuid.uuid4().hex}/run[1]?*"
    trainer = mlp_trainer()
    trainer.train_step(*BATCHES[0])
    trainer.save_checkpoint(f"{run}/ck.ortcp")
    key = f"{run.removeprefix('s3://')}/ck.ortcp"
    assert fs.isfile(key), fs.find(run.removeprefix("s3://").rsplit("/", 1)[0])
    manager = checkpoint.CheckpointManager(run, keep_last=1)
    manager.save(trainer, 1)
    manager.save(trainer, 2)
    assert manager.restore(mlp_trainer()).step == 2


def test_overwrite_false_on_s3_is_enforced_by_the_store_against_a_concurrent_writer(s3, monkeypatch):
    """Two writers both see no object, then both upload: only the first may succeed (S3 If-None-Match)."""
    fs, bucket = s3
    url = f"{bucket}/{uuid.uuid4().hex}/ck.ortcp"
    first, second = mlp_trainer(), mlp_trainer()
    first.train_step(*BATCHES[0])
    # every existence check (at the call, before the upload) ran before the other writer's upload finished
    monkeypatch.setattr(checkpoint.io.RemoteLocation, "exists", lambda self: False)
    first.save_checkpoint(url)
    with pytest.raises(checkpoint.CheckpointExistsError, match="already exists"):
        second.save_checkpoint(url)
    fresh = mlp_trainer()
    fresh.load_checkpoint(url)
    assert _same_state(fresh, first)
    assert [k for k in fs.ls(url.removeprefix("s3://").rsplit("/", 1)[0], refresh=True) if ".tmp-" in k] == []


@pytest.mark.processes
def test_a_killed_remote_save_leaves_nothing_that_the_next_save_does_not_remove(s3, tmp_path, monkeypatch):
    """Killed between the upload to the temporary key and the move: a full-size spool file in TMPDIR and a
    temporary object in the bucket remain; the next remote save (another process) removes both."""
    fs, bucket = s3
    folder = f"{bucket}/{uuid.uuid4().hex}"
    spool_root = tmp_path / "tmp"
    spool_root.mkdir()
    script = f"""
        import os, signal, torch
        import s3fs
        from ort_trainer import ORTTrainer, optim
        from tests.models import MLP, MLP_DESC
        real_put = s3fs.S3FileSystem.put_file
        def put_then_die(self, *args, **kwargs):
            real_put(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        s3fs.S3FileSystem.put_file = put_then_die
        trainer = ORTTrainer(MLP(hidden=256), MLP_DESC, optim.AdamConfig(lr=0.01),
                             loss_fn=torch.nn.functional.cross_entropy)
        trainer.save_checkpoint("{folder}/ck.ortcp", overwrite=True)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(spool_root)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == -9, result.stderr[-3000:]
    key_folder = folder.removeprefix("s3://")
    assert [k for k in fs.ls(key_folder, refresh=True) if ".tmp-" in k]  # the killed save's temporary object
    assert list(spool_root.iterdir())  # and its spool folder
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(spool_root))
    trainer = mlp_trainer()
    trainer.save_checkpoint(f"{folder}/ck.ortcp", overwrite=True)
    assert [k.rsplit("/", 1)[-1] for k in fs.ls(key_folder, refresh=True)] == ["ck.ortcp"]
    assert _ours(spool_root) == []


def _ours(folder: Path) -> list[Path]:
    """What is left in a TMPDIR, less the files torch itself leaves there when the dynamo exporter runs in
    that process (the autograd engine's build): its inductor cache folder and a session-id file."""
    return [p for p in folder.iterdir() if not (p.name.startswith("torchinductor_") or p.name == ".ses")]
