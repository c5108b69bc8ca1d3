"""Rank file naming, the JSON manifest of a distributed save, and its completeness / checksum checks."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from ort_trainer import checkpoint as C
from tests.rank_states import assert_same, full_state, save_ranks


def test_rank_file_and_manifest_names(tmp_path):
    assert C.rank_checkpoint_path(tmp_path / "ckpt.ortcp", 3, 8) == tmp_path / "ckpt.rank3-of-8.ortcp"
    assert C.rank_checkpoint_path("out/model", 0, 2) == Path("out/model.rank0-of-2")
    assert C.rank_checkpoint_path("ckpt.ortcp", 0, 1) == Path("ckpt.ortcp")  # a single process keeps the name
    assert C.manifest_path(tmp_path / "ckpt.ortcp") == tmp_path / "ckpt.ortcp.manifest.json"
    with pytest.raises(ValueError, match="rank must be < world_size=2, got 2"):
        C.rank_checkpoint_path("ckpt.ortcp", 2, 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        C.rank_checkpoint_path("ckpt.ortcp", 0, 0)


@pytest.fixture
def saved(tmp_path):
    """A 3-rank ZeRO save with its manifest, the way the trainer writes it."""
    full = full_state("AdamOptimizer")
    states = C.reshard_state(full, 3, zero_stage=1, run_id="run-1")
    paths = save_ranks(states, tmp_path)
    manifest = C.write_manifest(C.manifest_path(tmp_path / "ckpt.ortcp"), paths, world_size=3, step=8, run_id="run-1")
    return full, paths, manifest


def test_manifest_lists_every_file_with_size_and_crc(saved):
    _, paths, manifest = saved
    data = json.loads(manifest.path.read_text())
    assert data["format"] == "ort_trainer.checkpoint.manifest" and data["format_version"] == 2
    assert (data["run_id"], data["world_size"], data["step"]) == ("run-1", 3, 8)
    assert [(f["rank"], f["name"], f["size"]) for f in data["files"]] == [
        (r, p.name, p.stat().st_size) for r, p in enumerate(paths)
    ]
    assert [f["crc32"] for f in data["files"]] == [zlib.crc32(p.read_bytes()) for p in paths]
    assert C.read_manifest(manifest.path) == manifest
    assert C.check_manifest(manifest.path).rank_paths() == paths


def test_aggregate_from_a_manifest(saved):
    full, _, manifest = saved
    assert_same(full, C.aggregate_checkpoints(manifest.path))


def test_changed_byte_is_reported_with_its_file(saved):
    _, paths, manifest = saved
    data = bytearray(paths[1].read_bytes())
    data[len(data) // 2] ^= 0x01
    paths[1].write_bytes(bytes(data))
    with pytest.raises(C.CheckpointCorruptError) as info:
        C.check_manifest(manifest.path)
    message = str(info.value)
    assert f"rank 1 file {paths[1]}: CRC-32" in message and "(the file changed)" in message
    assert str(paths[0]) not in message and str(paths[2]) not in message
    C.check_manifest(manifest.path, checksums=False)  # sizes still match


def test_every_missing_or_resized_file_is_reported(saved):
    _, paths, manifest = saved
    paths[0].unlink()
    with open(paths[2], "ab") as fh:
        fh.write(b"x")
    with pytest.raises(C.CheckpointCorruptError) as info:
        C.check_manifest(manifest.path)
    message = str(info.value)
    assert f"rank 0 file {paths[0]} is missing" in message
    assert f"rank 2 file {paths[2]} has {paths[2].stat().st_size} bytes, the manifest says" in message
    with pytest.raises(C.CheckpointCorruptError, match="is missing"):
        C.aggregate_checkpoints(manifest.path)


def test_manifest_of_another_run_is_refused(saved, tmp_path):
    _, paths, _ = saved
    other = C.write_manifest(tmp_path / "other.manifest.json", paths, world_size=3, step=8, run_id="run-2")
    with pytest.raises(C.AggregationError, match=r"is for run_id 'run-2' but its files hold run_id 'run-1'"):
        C.aggregate_checkpoints(other.path)


def _rewrite(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_invalid_manifests_are_refused_with_every_problem(saved):
    _, _, manifest = saved
    path = manifest.path
    _rewrite(path, lambda d: d["files"].__setitem__(2, {**d["files"][1], "name": "../evil.ortcp"}))
    with pytest.raises(C.CheckpointFormatError) as info:
        C.read_manifest(path)
    assert "files[2].name: expected a plain file name in the manifest's folder, got '../evil.ortcp'" in str(info.value)
    _rewrite(path, lambda d: d["files"].__setitem__(2, {**d["files"][1], "name": "x.ortcp"}))
    with pytest.raises(C.CheckpointFormatError, match=r"ranks listed more than once: \[1\]; ranks missing: \[2\]"):
        C.read_manifest(path)
    _rewrite(path, lambda d: d.update(format_version=3))
    with pytest.raises(C.CheckpointVersionError, match="manifest version 3 is newer than 2"):
        C.read_manifest(path)
    _rewrite(path, lambda d: d.update(format="something else"))
    with pytest.raises(C.CheckpointFormatError, match="'format' is 'something else'"):
        C.read_manifest(path)
    path.write_text("{not json")
    with pytest.raises(C.CheckpointFormatError, match="is not a checkpoint manifest"):
        C.read_manifest(path)


def test_write_manifest_checks_its_input(saved, tmp_path):
    _, paths, manifest = saved
    with pytest.raises(ValueError, match=r"expected 3 rank files \(one per rank, in rank order\), got 2"):
        C.write_manifest(tmp_path / "m.manifest.json", paths[:2], world_size=3, step=1, run_id="r")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="rank files must be in the manifest's folder"):
        C.write_manifest(tmp_path / "sub" / "m.manifest.json", paths, world_size=3, step=1, run_id="r")
    with pytest.raises(C.CheckpointExistsError, match="already exists"):
        C.write_manifest(manifest.path, paths, world_size=3, step=1, run_id="r")
    C.write_manifest(manifest.path, paths, world_size=3, step=9, run_id="run-1", overwrite=True)
    assert C.read_manifest(manifest.path).step == 9
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
