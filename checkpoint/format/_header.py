"""A checksummed header in the HDF5 user block, verified before HDF5 parses the file.

HDF5 (through h5py) can crash the process on some damaged files, so a checkpoint carries, in
the user block that HDF5 reserves and skips, the file size, the byte ranges holding raw array
data, and a CRC-32 of every other byte (superblock, object headers, attributes, heaps).
Checking it costs a read of the metadata only; raw data is covered by per-dataset checksums.

Layout (little endian): magic ``b"ORTCKPT\\0"``, u32 header version, u32 number of ranges,
u64 user block size, u64 file size, u32 metadata CRC-32, u32 header CRC-32 (of the 32 bytes
before it followed by the ranges), then the ranges as (u64 offset, u64 length), sorted.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointCorruptError

__all__ = ["HEADER_MAGIC", "check_header", "userblock_size", "write_header"]

HEADER_MAGIC = b"ORTCKPT\x00"
_HEADER_VERSION = 1
_FIXED = struct.Struct("<8sIIQQII")
_RANGE = struct.Struct("<QQ")
_MAX_RANGES = 1 << 24
_READ_CHUNK = 16 << 20


def userblock_size(max_ranges: int) -> int:
    """Smallest HDF5 user block (a power of two >= 512) that holds a header with ``max_ranges``."""
    need = _FIXED.size + _RANGE.size * max_ranges
    return max(512, 1 << (need - 1).bit_length())


def _gaps(start: int, end: int, ranges: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The (offset, length) pieces of [start, end) not covered by the sorted ``ranges``."""
    pos = start
    for offset, length in ranges:
        if offset > pos:
            yield pos, offset - pos
        pos = max(pos, offset + length)
    if end > pos:
        yield pos, end - pos


def _metadata_crc(fh: BinaryIO, start: int, end: int, ranges: list[tuple[int, int]]) -> int:
    crc = 0
    for offset, length in _gaps(start, end, ranges):
        fh.seek(offset)
        while length:
            chunk = fh.read(min(length, _READ_CHUNK))
            if not chunk:
                raise OSError("unexpected end of file")
            crc, length = zlib.crc32(chunk, crc), length - len(chunk)
    return crc


def write_header(path: Path, ub_size: int, data_ranges: list[tuple[int, int]]) -> None:
    """Stamp the header into the (closed) HDF5 file at ``path`` whose user block is ``ub_size``."""
    ranges = sorted((o, n) for o, n in data_ranges if n > 0)
    file_size = path.stat().st_size
    with open(path, "r+b") as fh:
        meta_crc = _metadata_crc(fh, ub_size, file_size, ranges)
        body = b"".join(_RANGE.pack(o, n) for o, n in ranges)
        fixed = _FIXED.pack(HEADER_MAGIC, _HEADER_VERSION, len(ranges), ub_size, file_size, meta_crc, 0)[:-4]
        header = fixed + struct.pack("<I", zlib.crc32(body, zlib.crc32(fixed))) + body
        if len(header) > ub_size:
            raise RuntimeError(f"{path}: header of {len(header)} bytes does not fit the {ub_size}-byte user block")
        fh.seek(0)
        fh.write(header)


def _parse(fh: BinaryIO, path: Path, file_size: int) -> tuple[int, int, int, list[tuple[int, int]]] | None:
    fixed = fh.read(_FIXED.size)
    if len(fixed) < _FIXED.size or not fixed.startswith(HEADER_MAGIC):
        return None
    _, version, count, ub_size, size, meta_crc, header_crc = _FIXED.unpack(fixed)
    if version != _HEADER_VERSION or count > _MAX_RANGES or _FIXED.size + _RANGE.size * count > min(ub_size, file_size):
        raise CheckpointCorruptError(f"{path}: damaged checkpoint header (version {version}, {count} ranges)")
    body = fh.read(_RANGE.size * count)
    if zlib.crc32(body, zlib.crc32(fixed[:-4])) != header_crc:
        raise CheckpointCorruptError(f"{path}: damaged checkpoint header (header checksum mismatch)")
    ranges = [_RANGE.unpack_from(body, i * _RANGE.size) for i in range(count)]
    return ub_size, size, meta_crc, ranges


def check_header(path: Path, fh: BinaryIO | None = None) -> bool:
    """Verify the header and metadata checksum; False if the file has no header (legacy/rewritten).

    Raises CheckpointCorruptError for a damaged header, a truncated or extended file, or damaged
    HDF5 metadata, before HDF5 ever reads the file. With ``fh`` (the file already open), the size and
    the bytes come from that open file: a save replacing ``path`` meanwhile cannot mix two files.
    """
    try:
        if fh is not None:
            fh.seek(0)
            return _check_open(fh, path, os.fstat(fh.fileno()).st_size)
        with open(path, "rb") as opened:
            return _check_open(opened, path, os.fstat(opened.fileno()).st_size)
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: cannot read the checkpoint header ({exc})") from exc


def _check_open(fh: BinaryIO, path: Path, file_size: int) -> bool:
    parsed = _parse(fh, path, file_size)
    if parsed is None:
        return False
    ub_size, size, meta_crc, ranges = parsed
    if size != file_size:
        raise CheckpointCorruptError(
            f"{path}: file is {file_size} bytes but was written with {size} (truncated or modified)"
        )
    ends = [o + n for o, n in ranges]
    if (
        any(o < ub_size for o, _ in ranges[:1])
        or any(e > file_size for e in ends[-1:])
        or any(ranges[i + 1][0] < ends[i] for i in range(len(ranges) - 1))
    ):
        raise CheckpointCorruptError(f"{path}: damaged checkpoint header (invalid data ranges)")
    if _metadata_crc(fh, ub_size, file_size, ranges) != meta_crc:
        raise CheckpointCorruptError(f"{path}: HDF5 metadata checksum mismatch: the file structure is damaged")
    return True
