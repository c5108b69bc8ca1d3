"""Crafted (hostile or impossible) checkpoint files, for tests that every reader refuses them quickly.

Each case starts from a valid single-process trainer checkpoint (``base_tree``), replaces one dataset
(or the whole file) with something our writer never produces, and then re-stamps the structure digest
and the checksummed header with the library's own functions, so that the file passes every integrity
check and only the reader's validation can catch it: crafted files have valid checksums.

``CASES`` maps a case name to ``(builder, expected message regex, the readers that must refuse it)``;
``ACCEPTED`` lists sound files in layouts our writer does not use, which every reader must accept;
``build(name, folder)`` writes a case's input (a checkpoint file, or a manifest with its rank file) and
returns its path.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from h5py import h5d, h5p, h5s, h5t

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.format import _h5_lowlevel as ll
from ort_trainer.checkpoint.format import schema as S
from ort_trainer.checkpoint.format._checksum import for_version
from ort_trainer.checkpoint.format._h5_index import Node, tree_digest
from ort_trainer.checkpoint.format._header import write_header
from tests.builders import legacy_trainer_options

__all__ = ["ACCEPTED", "CASES", "SET_READERS", "TARGET", "base_tree", "build", "restamp"]

TARGET = "model/full_precision/0.bias"  # the dataset a case replaces: every reader reads it
CHECKSUM = for_version(S.FORMAT_VERSION)  # what the writer stores today
_ATTRS = (CHECKSUM.attr, S.ATTR_PY_TYPE, S.ATTR_TORCH_DTYPE)


def base_tree() -> dict:
    """What ``ORTTrainer.save_checkpoint`` writes for a ``Linear(4, 3)`` before its first step."""
    gen = torch.Generator().manual_seed(0)
    options = legacy_trainer_options()
    return {
        "model": {"full_precision": {"0.weight": torch.randn(3, 4, generator=gen), "0.bias": torch.zeros(3)}},
        "train_step_info": {"optimization_step": 0, "step": 0},
        "trainer_options": options,
    }


# ---- re-stamping: digest and header computed like the writer does -------------------------------------
def _index(f: h5py.File, ours: bool) -> tuple[Node, list[tuple[int, int]]]:
    root, ranges = Node("/", (), True), []
    nodes = {"/": root}

    def visit(name: str, obj) -> None:
        h5path = "/" + name
        parent = nodes[h5path.rpartition("/")[0] or "/"]
        key = (*parent.key, name.rpartition("/")[2])
        if isinstance(obj, h5py.Group):
            node = nodes[h5path] = Node(h5path, key, True)
        else:
            space = obj.id.get_space()
            shape = None if space.get_simple_extent_type() == h5s.NULL else space.shape
            attrs = ll.read_attrs(obj.id, _ATTRS) if ours else {}
            node = Node(h5path, key, False, shape=shape, dtype=obj.id.dtype, attrs=attrs)
            layout = obj.id.get_create_plist().get_layout()
            if layout == h5d.CONTIGUOUS and obj.id.dtype.kind != "O" and obj.id.get_storage_size() > 0:
                ranges.append((obj.id.get_offset(), obj.id.get_storage_size()))
        parent.children[key[-1]] = node

    f.visititems(visit)
    return root, ranges


def restamp(path: Path) -> None:
    """Recompute the structure digest and the header of an edited file: its checksums are valid again."""
    with h5py.File(path, "r+") as f:
        ours = S.ATTR_FORMAT in f.attrs
        if ours:
            root, _ = _index(f, ours)
            attrs = {k: f.attrs[k] for k in S.ROOT_ATTRS if k in f.attrs}
            attrs = {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
            f.attrs[S.ATTR_TREE_CRC32] = np.uint32(tree_digest(root, attrs))
        _, ranges = _index(f, ours)
        ub_size = f.userblock_size
    if ub_size:
        write_header(path, ub_size, ranges)


def _dataset_crc(data) -> int:
    """The per-dataset checksum the writer would store for ``data`` (the library's own function)."""
    payload = C.format._codec.leaf_array(C.format._codec.encode_leaf(data, "x"))
    return CHECKSUM.strings(payload) if isinstance(payload, str | list) else CHECKSUM.array(payload)


def _replace(f: h5py.File, h5path: str, create: Callable[[h5py.Group, str], h5py.Dataset], attrs: dict) -> None:
    parent, _, name = h5path.rpartition("/")
    group = f[parent or "/"]
    del group[name]
    ds = create(group, name)
    for key, value in attrs.items():
        ds.attrs[key] = np.uint32(value) if isinstance(value, int) else value


def _crafted_file(folder: Path, edit: Callable[[h5py.File], None], *, legacy: bool = False) -> Path:
    path = folder / "crafted.ortcp"
    tree = base_tree()
    C.save(tree, path, overwrite=True)
    with h5py.File(path, "r+") as f:
        if legacy:
            for key in list(f.attrs):
                del f.attrs[key]
        edit(f)
    restamp(path)
    if legacy:  # no header either: a file as another tool would write it
        data = bytearray(path.read_bytes())
        data[:8] = b"\x00" * 8
        path.write_bytes(bytes(data))
    return path


def _tensor(create, crc: int | None = 0, **extra) -> Callable[[h5py.File], None]:
    """Replace TARGET by ``create(group, name)`` with tensor attributes (no checksum attribute if ``crc`` is None)."""
    attrs = {S.ATTR_PY_TYPE: S.PY_TENSOR, **({} if crc is None else {CHECKSUM.attr: crc}), **extra}
    return lambda f: _replace(f, TARGET, create, attrs)


def _filtered(**kwargs) -> Callable[[h5py.Group, str], h5py.Dataset]:
    return lambda g, n: g.create_dataset(n, shape=(2**40,), dtype="f4", chunks=(1 << 16,), **kwargs)


def _gzip_bomb(f: h5py.File) -> None:
    """1 GiB of zeros in 256 gzip chunks of 4 MiB (about 4 KB each), with their valid checksum."""
    chunk = np.zeros(1 << 20, dtype=np.float32)
    packed = zlib.compress(chunk.tobytes(), 9)
    crc = 0
    for _ in range(256):
        crc = CHECKSUM.array(chunk, crc)

    def create(g, n):
        ds = g.create_dataset(n, shape=(256 << 20,), dtype="f4", chunks=(1 << 20,), compression="gzip")
        for i in range(256):
            ds.id.write_direct_chunk((i << 20,), packed)
        return ds

    _tensor(create, crc)(f)


def _compact_lowlevel(group: h5py.Group, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> h5py.Dataset:
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_layout(h5d.COMPACT)
    dsid = h5d.create(group.id, name.encode(), h5t.py_create(dtype, logical=True), h5s.create_simple(shape), dcpl=dcpl)
    return h5py.Dataset(dsid)


def _partial_chunks(g: h5py.Group, n: str) -> h5py.Dataset:
    ds = g.create_dataset(n, shape=(4096,), dtype="f4", chunks=(1024,))
    ds[:1024] = 1.0  # one chunk of 4 written: the rest would read as fill values
    return ds


def _vlen_unwritten(count: int) -> Callable[[h5py.File], None]:
    """A list of ``count`` strings that was never written (no storage: every element reads as fill)."""

    def edit(f: h5py.File) -> None:
        create = lambda g, n: g.create_dataset(n, shape=(count,), dtype=h5py.string_dtype())  # noqa: E731
        _replace(f, "trainer_options/optimizer_name", create, {S.ATTR_PY_TYPE: S.PY_LIST, CHECKSUM.attr: 0})

    return edit


def _vlen_shared(f: h5py.File) -> None:
    """2**16 list elements that all point at the same 1 MiB heap string: 64 GiB from a 2 MiB file."""
    values = ["x" * (1 << 20)] + [""] * ((1 << 16) - 1)
    create = lambda g, n: g.create_dataset(n, data=values, dtype=h5py.string_dtype())  # noqa: E731
    _replace(f, "trainer_options/optimizer_name", create, {S.ATTR_PY_TYPE: S.PY_LIST, CHECKSUM.attr: 0})
    ds = f["trainer_options/optimizer_name"]
    offset, size = ds.id.get_offset(), ds.id.get_storage_size()
    f.flush()
    with open(f.filename, "r+b") as fh:
        fh.seek(offset)
        raw = bytearray(fh.read(size))
        width = size // len(values)
        raw[:] = bytes(raw[:width]) * len(values)  # every element's heap id := element 0's
        fh.seek(offset)
        fh.write(raw)


def _value(h5path: str, data, py_type: str, **extra) -> Callable[[h5py.File], None]:
    attrs = {S.ATTR_PY_TYPE: py_type, CHECKSUM.attr: _dataset_crc(data), **extra}
    return lambda f: _replace(f, h5path, lambda g, n: g.create_dataset(n, data=data), attrs)


def _world_size(value: int) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        for key, v in ((S.WORLD_SIZE_KEY, value), (S.DATA_PARALLEL_SIZE_KEY, value), (S.ZERO_STAGE_KEY, 1)):
            _value(f"trainer_options/{key}", np.int64(v), S.PY_INT)(f)

    return edit


def _manifest(folder: Path, world_size: int) -> Path:
    """A 300-byte manifest declaring ``world_size`` ranks, listing one file."""
    rank = folder / "ckpt.rank0-of-2.ortcp"
    C.save(base_tree(), rank, overwrite=True)
    path = folder / "ckpt.ortcp.manifest.json"
    entry = {"rank": 0, "name": rank.name, "size": rank.stat().st_size, "crc32": 0}
    doc = {"format": S.MANIFEST_FORMAT_NAME, "format_version": 1, "run_id": "r", "world_size": world_size, "step": 0}
    path.write_text(json.dumps({**doc, "files": [entry]}))
    return path


def _file(edit, **kw) -> Callable[[Path], Path]:
    return lambda folder: _crafted_file(folder, edit, **kw)


_TOO_BIG = r"(claims \d+ bytes but the file has only \d+|a dimension larger than the file's \d+ bytes)"
_FILTER = r"refusing dataset '/model/full_precision/0.bias' with HDF5 filter"
_UNWRITTEN = r"declares \d+ bytes of data but stores only \d+ \(never or only partly written\)"
_BAD_TYPE = r"has unsupported HDF5 type"
# the readers that interpret trainer_options and rank sets (the others read one file's values as they are)
SET_READERS = frozenset({"aggregate", "aggregate_to_file", "cli_verify", "cli_aggregate", "trainer_load"})


def _chunked_written(g: h5py.Group, n: str) -> h5py.Dataset:
    return g.create_dataset(n, data=np.zeros(3, "f4"), chunks=(2,))


def _compact_vlen(f: h5py.File) -> None:
    def create(g, n):
        ds = _compact_lowlevel(g, n, h5py.string_dtype(), (2,))
        ds[...] = np.array(["a", "b"], dtype=object)
        return ds

    _replace(f, "trainer_options/optimizer_name", create, {S.ATTR_PY_TYPE: S.PY_LIST, CHECKSUM.attr: 0})


# name -> (builder, message regex, readers that must refuse it: None = every reader)
CASES: dict[str, tuple[Callable[[Path], Path], str, frozenset | None]] = {
    # point 2: built-in filters are refused (none is allowed), whatever their size
    "gzip_2**40": (_file(_tensor(_filtered(compression="gzip"))), _FILTER, None),
    "shuffle_2**40": (_file(_tensor(_filtered(shuffle=True))), _FILTER, None),
    "fletcher32_2**40": (_file(_tensor(_filtered(fletcher32=True))), _FILTER, None),
    "scaleoffset_2**40": (_file(_tensor(_filtered(scaleoffset=3))), _FILTER, None),
    "lzf_2**40": (_file(_tensor(_filtered(compression="lzf"))), _FILTER, None),
    "szip_2**40": (_file(_tensor(_filtered(compression="szip"))), _FILTER, None),
    "gzip_bomb_1GiB": (_file(_gzip_bomb), _FILTER, None),
    "legacy_gzip_2**40": (_file(_tensor(_filtered(compression="gzip")), legacy=True), _FILTER, None),
    # declared sizes bounded by the file and by the storage really allocated
    "contiguous_unwritten_2**40": (
        _file(_tensor(lambda g, n: g.create_dataset(n, shape=(2**40,), dtype="f4"))),
        _TOO_BIG,
        None,
    ),
    "contiguous_unwritten_4000": (
        _file(_tensor(lambda g, n: g.create_dataset(n, shape=(4000,), dtype="f4"))),
        _UNWRITTEN,
        None,
    ),
    "chunked_unwritten_2**40": (
        _file(_tensor(lambda g, n: g.create_dataset(n, shape=(2**40,), dtype="f4", chunks=(1024,)))),
        _TOO_BIG,
        None,
    ),
    "chunked_partly_written": (_file(_tensor(_partial_chunks)), _UNWRITTEN, None),
    "zero_extent_2**62": (
        _file(_tensor(lambda g, n: g.create_dataset(n, shape=(2**62, 0), dtype="f4"))),
        _TOO_BIG,
        None,
    ),
    # point 4: variable-length strings and opaque data
    "vlen_list_unwritten_2**26": (_file(_vlen_unwritten(1 << 26)), _TOO_BIG, None),
    "vlen_list_unwritten_1000": (_file(_vlen_unwritten(1000)), _UNWRITTEN, None),
    "legacy_vlen_list_unwritten_1000": (_file(_vlen_unwritten(1000), legacy=True), _UNWRITTEN, None),
    "vlen_list_shared_heap_64GiB": (_file(_vlen_shared), r"holds strings of \d+ bytes in all", None),
    "vlen_list_compact": (_file(_compact_vlen), r"variable-length strings with compact layout", None),
    "opaque_tensor": (_file(_tensor(lambda g, n: g.create_dataset(n, data=np.void(b"\x00" * 12)))), _BAD_TYPE, None),
    "opaque_huge_rows": (
        _file(_tensor(lambda g, n: g.create_dataset(n, shape=(2**40, 0), dtype=np.dtype("V7")))),
        _BAD_TYPE,
        None,
    ),
    "compound_tensor": (
        _file(_tensor(lambda g, n: g.create_dataset(n, data=np.zeros(3, dtype=[("a", "f4"), ("b", "i4")])))),
        _BAD_TYPE,
        None,
    ),
    # point 4: attributes that contradict the data: every reader must agree that this is corrupt
    "py_type_int_on_float": (_file(_value(TARGET, np.float64(1.5), S.PY_INT)), r"py_type", None),
    "py_type_unknown_on_tensor": (_file(_value(TARGET, np.zeros(3, "f4"), "garbage")), r"py_type", None),
    "py_type_list_on_2d": (_file(_value(TARGET, np.zeros((3, 1), "i8"), S.PY_LIST)), r"py_type", None),
    "py_type_str_on_float": (_file(_value(TARGET, np.zeros(3, "f4"), S.PY_STR)), r"py_type", None),
    "torch_dtype_on_float32": (
        _file(_value(TARGET, np.zeros(3, "f4"), S.PY_TENSOR, torch_dtype="bfloat16")),
        r"torch_dtype",
        None,
    ),
    "checksum_attribute_missing": (
        _file(_tensor(lambda g, n: g.create_dataset(n, data=np.zeros(3, "f4")), None)),
        r"no valid crc32c attribute|checksum mismatch",
        None,
    ),
    # point 3: world sizes far beyond the files present
    "rank_file_world_size_2**40": (_file(_world_size(2**40)), r"world_size 1099511627776", SET_READERS),
    "trainer_options_world_size_str": (
        _file(_value("trainer_options/world_size", "abc", S.PY_STR)),
        r"world_size",
        SET_READERS,
    ),
    "trainer_options_zero_stage_negative": (
        _file(_value("trainer_options/zero_stage", np.int64(-1), S.PY_INT)),
        r"zero_stage: expected (an int )?>= 0",
        SET_READERS,
    ),
    "manifest_world_size_2**40": (
        lambda folder: _manifest(folder, 2**40),
        r"world_size is 1099511627776|not an HDF5 file",
        None,
    ),
}
# Files our writer does not write but that are sound (other tools' layouts): every reader accepts them.
ACCEPTED: dict[str, Callable[[Path], Path]] = {
    "compact_float32": _file(
        _tensor(lambda g, n: _compact_lowlevel(g, n, np.dtype("f4"), (3,)), _dataset_crc(np.zeros(3, "f4")))
    ),
    "chunked_unfiltered_written": _file(_tensor(_chunked_written, _dataset_crc(np.zeros(3, "f4")))),
}


def build(name: str, folder: Path) -> Path:
    """Write case ``name`` into the (empty) ``folder``; return the path to hand to the readers."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return (CASES[name][0] if name in CASES else ACCEPTED[name])(folder)
