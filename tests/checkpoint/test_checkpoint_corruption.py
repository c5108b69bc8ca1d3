"""Damaged files: every load returns the original data exactly or raises a CheckpointError, nothing else.

h5py can crash the interpreter on some damaged HDF5 files (seen while fuzzing files without our
header), so the seeded cases run in child processes (``tests/checkpoint/fuzz_runner.py``): a crash or a hang is
recorded for its case, the child restarted, and the test fails naming the case. ``verify`` must agree
with ``load`` on every case.
"""

from __future__ import annotations

import random
from collections import Counter

import h5py
import numpy as np
import pytest
import torch

from ort_trainer import checkpoint as C
from tests.checkpoint.fuzz_runner import run_cases
from tests.paths import FIXTURES

SEED = 424242


def _tree():
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {"full_precision": {f"layer{i}.weight": torch.randn(96, 96, generator=gen) for i in range(12)}},
        "optimizer": {
            f"layer{i}.weight": {
                "Moment_1": torch.randn(96, 96, generator=gen),
                "Moment_2": torch.rand(96, 96, generator=gen).bfloat16(),
                "Update_Count": torch.tensor([9]),
            }
            for i in range(8)
        },
        "trainer_options": {"optimizer_name": "AdamOptimizer", "zero_stage": 0, "mixed_precision": False},
        "user_dict": C.encode_user_dict({"epoch": 3, "pair": (1, "a"), "arr": np.arange(4)}),
        "misc": {"none": None, "bytes": b"\x00\x01", "floats": [1.5, 2.5], "strs": ["a", "bé"], "empty": {}},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "c.ortcp"
    C.save(_tree(), path)
    return path


def _cases(size, seed=SEED, count=100):
    """Truncations at the edges and at random, byte inversions, and single bits near both ends (metadata)."""
    rng = random.Random(seed)
    edges = [0, 1, 8, 39, 40, 511, 512, 513, size // 2, size - 1]
    cases = [("truncate", o) for o in edges + [rng.randrange(size) for _ in range(count - 10)]]
    cases += [("flip", rng.randrange(size)) for _ in range(count)]
    # metadata lives mostly at both ends of the file: more bit flips there
    cases += [("bit", rng.randrange(0, min(size, 8192))) for _ in range(count * 3 // 10)]
    cases += [("bit", rng.randrange(max(0, size - 8192), size)) for _ in range(count * 3 // 10)]
    return cases


def _check(results, cases):
    assert len(results) == len(cases)
    bad = [r for r in results if not (r[2] == "same" or r[2].startswith("error:"))]
    assert not bad, bad
    disagree = [r for r in results if (r[2] == "same") != (r[3] == "same")]
    assert not disagree, f"load and verify disagree: {disagree}"
    assert all(r[2].startswith("error:") for r in results if r[0] == "truncate"), "a truncated file loaded"
    return Counter(r[2] for r in results)


def test_damaged_files_load_identically_or_raise_checkpoint_error(saved, tmp_path):
    size = saved.stat().st_size
    assert 0.8e6 < size < 1.5e6
    cases = _cases(size)
    assert len(cases) >= 200
    counts = _check(run_cases(saved, cases, tmp_path), cases)
    assert counts["error:CheckpointCorruptError"] > 100, counts
    print(f"{len(cases)} damaged files: {dict(counts)}")


def _many_small_tree():
    """A trainer-like file: hundreds of small datasets, strings and lists (mostly metadata)."""
    return {
        "model": {f"layer{i}": {"w": torch.full((8, 8), float(i)), "b": torch.arange(8) + i} for i in range(60)},
        "train_step_info": {"optimization_step": 12, "step": 24},
        "user_dict": C.encode_user_dict({"names": [f"n{i}" for i in range(40)], "epoch": 3, "note": "é" * 100}),
    }


@pytest.mark.faults
def test_damage_sweep_780_cases_over_three_files(saved, tmp_path):
    """The long sweep (make test-faults): 780 more cases over a large-array file, a metadata-heavy file and a
    format-version-1 (CRC-32) fixture, each in a child that may crash or hang without hiding the case."""
    small = tmp_path / "small.ortcp"
    C.save(_many_small_tree(), small)
    v1 = tmp_path / "v1.ortcp"
    v1.write_bytes((FIXTURES / "format_v1" / "tree_crc32.ortcp").read_bytes())
    total = Counter()
    for source, seed, count in ((saved, 1, 100), (small, 2, 100), (v1, 3, 100)):
        cases = _cases(source.stat().st_size, seed, count)
        total += _check(run_cases(source, cases, tmp_path), cases)
    assert sum(total.values()) >= 780, total
    print(f"{sum(total.values())} damaged files: {dict(total)}")


def _damage(path, offset, xor=0xFF):
    data = bytearray(path.read_bytes())
    data[offset] ^= xor
    path.write_bytes(bytes(data))


def test_error_messages_name_file_and_damage(saved, tmp_path):
    original = saved.read_bytes()
    victim = tmp_path / "victim.ortcp"
    victim.write_bytes(original[: len(original) // 2])
    with pytest.raises(C.CheckpointCorruptError, match=r"victim.ortcp: file is \d+ bytes but was written with \d+"):
        C.load(victim)
    victim.write_bytes(original)
    _damage(victim, len(original) - 100)  # HDF5 metadata at the end of the file
    with pytest.raises(C.CheckpointCorruptError, match=r"victim.ortcp: HDF5 metadata checksum mismatch"):
        C.load(victim)
    victim.write_bytes(original)
    with h5py.File(victim, "r") as f:
        offset = f["optimizer/layer3.weight/Moment_2"].id.get_offset()
    _damage(victim, offset + 7)
    message = r"victim.ortcp: checksum mismatch in 1 dataset\(s\): .*'/optimizer/layer3.weight/Moment_2'"
    with pytest.raises(C.CheckpointCorruptError, match=message):
        C.load(victim)
    assert C.load(victim, "trainer_options")["optimizer_name"] == "AdamOptimizer"  # undamaged parts stay readable
    victim.write_bytes(original)
    _damage(victim, 20)  # inside our header
    with pytest.raises(C.CheckpointCorruptError, match=r"victim.ortcp: damaged checkpoint header"):
        C.load(victim)


def test_file_without_header_is_guarded_by_structure_digest(saved, tmp_path):
    """A file whose header is gone (e.g. rewritten by another tool) still gets the structure checksum."""
    victim = tmp_path / "noheader.ortcp"
    victim.write_bytes(b"\x00" * 8 + saved.read_bytes()[8:])  # wipe the magic: no header
    assert C.load(victim, "trainer_options")["optimizer_name"] == "AdamOptimizer"
    with h5py.File(victim, "r+") as f:
        f["misc/floats"].attrs["py_type"] = "tuple"
    with pytest.raises(C.CheckpointCorruptError, match=r"noheader.ortcp: structure checksum mismatch"):
        C.load(victim)
    rewritten = tmp_path / "rewritten.ortcp"
    rewritten.write_bytes(saved.read_bytes())
    with h5py.File(rewritten, "r+") as f:
        f["misc/floats"].attrs["py_type"] = "tuple"
    with pytest.raises(C.CheckpointCorruptError, match=r"rewritten.ortcp: (file is \d+ bytes|HDF5 metadata checksum)"):
        C.load(rewritten)
