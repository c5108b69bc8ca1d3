"""The per-dataset checksums: CRC-32C (format version 2) and zlib CRC-32 (version 1), by the standard check values."""

from __future__ import annotations

import zlib

import google_crc32c
import numpy as np
import pytest
import torch

from ort_trainer import checkpoint
from ort_trainer.checkpoint.format import _checksum as K
from ort_trainer.checkpoint.format import schema as S


def test_standard_check_values():
    data = np.frombuffer(b"123456789", dtype=np.uint8)
    assert K.CRC32C.array(data) == 0xE3069283  # CRC-32C (Castagnoli) of "123456789"
    assert K.CRC32.array(data) == 0xCBF43926  # CRC-32 (zlib) of "123456789"
    assert K.CRC32C.strings("123456789") == 0xE3069283
    assert K.CRC32C.strings(["12345", "789"]) == google_crc32c.value(b"12345\x00789\x00")
    assert (K.CRC32C.attr, K.CRC32.attr) == ("crc32c", "crc32")
    assert K.for_version(2) is K.CRC32C and K.for_version(1) is K.CRC32 and K.for_version(0) is None
    assert K.for_version(S.FORMAT_VERSION) is K.CRC32C


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (K.PIECE_BYTES // 4 + 3,), (700, 900)])
def test_array_pieces_and_running_values_agree_with_the_library(shape):
    array = np.random.default_rng(1).random(shape).astype(np.float32)
    raw = array.tobytes()
    assert K.CRC32C.array(array) == google_crc32c.value(raw)
    assert K.CRC32.array(array) == zlib.crc32(raw)
    running = 0
    for piece in K.CRC32C.pieces(array):  # what the writer does: piece by piece as the bytes go out
        assert piece.nbytes <= K.PIECE_BYTES
        running = K.CRC32C.extend(running, piece)
    assert running == google_crc32c.value(raw)
    assert K.CRC32C.array(array[::-1].copy(), K.CRC32C.array(array)) == google_crc32c.value(raw + array[::-1].tobytes())


def test_arrays_are_checksummed_in_place_without_a_copy():
    """A 24 MiB array is checksummed through a view of its memory: no allocation of its size."""
    import tracemalloc

    array = np.random.default_rng(2).random(3 * (1 << 20))
    expected = google_crc32c.value(array.tobytes())
    tracemalloc.start()
    try:
        got = K.CRC32C.array(array)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == expected
    assert peak < (1 << 20), f"checksumming allocated {peak} bytes (a copy of the array?)"


def test_reads_after_a_full_verify_do_not_checksum_again(tmp_path, monkeypatch):
    """verify() of the whole file checks every dataset once; the reads that follow skip a second pass."""
    from ort_trainer.checkpoint.format import _checksum

    path = tmp_path / "c.ortcp"
    tensors = {f"w{i}": torch.randn(300, 1000) for i in range(3)}
    checkpoint.save(tensors, path)
    calls = []
    original = _checksum.Checksum.array

    def counting(self, data, value=0):
        calls.append(data.nbytes)
        return original(self, data, value)

    monkeypatch.setattr(_checksum.Checksum, "array", counting)
    with checkpoint.open_checkpoint(path) as reader:
        reader.read("w0")  # before verify(): checksummed
        before = sum(calls)
        assert before >= tensors["w0"].numel() * 4
        assert reader.verify() == 3
        verified = sum(calls)
        assert verified - before >= sum(t.numel() * 4 for t in tensors.values())
        out = torch.empty(300, 1000)
        reader.read_into("w1", out)
        assert torch.equal(reader.read("w2"), tensors["w2"]) and torch.equal(out, tensors["w1"])
        assert sum(calls) == verified


def test_a_file_modified_in_place_after_verify_is_checked_again(tmp_path):
    """A `cp` over the file after verify(): the reads that follow checksum again and see the damage."""
    import os

    path = tmp_path / "c.ortcp"
    checkpoint.save({"w": torch.arange(100_000, dtype=torch.float32)}, path)
    with checkpoint.open_checkpoint(path) as reader:
        reader.verify()
        info = os.stat(path)
        with open(path, "r+b") as fh:  # flip one byte of the array's data, in place
            data = fh.read()
            at = data.index(torch.tensor([50_000.0]).numpy().tobytes())
            fh.seek(at)
            fh.write(bytes([data[at] ^ 0xFF]))
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000))
        with pytest.raises(checkpoint.CheckpointCorruptError, match="checksum mismatch"):
            reader.read("w")
