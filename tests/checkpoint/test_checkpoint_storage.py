"""Round trips, partial loads, overwrite rules, errors and the golden on-disk layout of checkpoint storage."""

from __future__ import annotations

import math
import subprocess
import sys

import google_crc32c
import h5py
import numpy as np
import pytest
import torch

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.format import _atomic
from tests.builders import legacy_trainer_options


def assert_same(expected, got, where="root"):
    """Exact equality: same python types, tensors with the same dtype/shape/bits."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape, got.device.type) == (expected.dtype, expected.shape, "cpu"), where
        assert got.contiguous().view(-1).view(torch.uint8).equal(expected.contiguous().view(-1).view(torch.uint8)), (
            where
        )
        return
    assert type(got) is type(expected), f"{where}: {type(got)} != {type(expected)}"
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same(expected[key], got[key], f"{where}/{key}")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), where
    else:
        assert got == expected, where
        if isinstance(expected, float):
            assert math.copysign(1, got) == math.copysign(1, expected), where


def roundtrip(tmp_path, tree, name="ckpt.ortcp"):
    C.save(tree, tmp_path / name)
    return C.load(tmp_path / name)


# ---- round trips ---------------------------------------------------------------------------------
g = torch.Generator().manual_seed(0)
TENSORS = {
    "f32": torch.randn(3, 4, generator=g),
    "f16": torch.randn(5, generator=g).half(),
    "bf16": torch.randn(2, 3, generator=g).bfloat16(),
    "f64": torch.randn(2, dtype=torch.float64, generator=g),
    "i8": torch.tensor([-128, 127], dtype=torch.int8),
    "i16": torch.tensor([-5, 5], dtype=torch.int16),
    "i32": torch.tensor([1, 2], dtype=torch.int32),
    "u8": torch.tensor([0, 255], dtype=torch.uint8),
    "bool": torch.tensor([True, False]),
    "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    "f8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
    "int64_scalar": torch.tensor(7),
    "bf16_scalar": torch.tensor(1.5, dtype=torch.bfloat16),
    "empty": torch.zeros(0, 3),
    "update_count": torch.tensor([9]),
}


def test_tensor_round_trip_every_dtype(tmp_path):
    assert_same(TENSORS, roundtrip(tmp_path, TENSORS))


def test_noncontiguous_and_grad_tensors_are_saved_by_value(tmp_path):
    base = torch.randn(4, 6, generator=g)
    tree = {"t": base.t(), "param": torch.nn.Parameter(torch.ones(3)), "view": base[1:3]}
    out = roundtrip(tmp_path, tree)
    assert_same({k: v.detach().contiguous() for k, v in tree.items()}, out)


def test_numpy_values_come_back_as_tensors(tmp_path):
    tree = {
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "zero_d": np.array(2.5, dtype=np.float32),
        "scalar": np.float16(1.25),
        "big_endian": np.arange(3, dtype=">f8"),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "bool": np.array([True, False]),
    }
    out = roundtrip(tmp_path, tree)
    expected = {
        k: torch.from_numpy(np.asarray(v, dtype=np.asarray(v).dtype.newbyteorder("="), order="C"))
        for k, v in tree.items()
    }
    assert_same(expected, out)


PYTHON_VALUES = {
    "int": 3,
    "neg_big": -(2**62),
    "float": 0.1,
    "nan": float("nan"),
    "inf": float("-inf"),
    "neg_zero": -0.0,
    "true": True,
    "false": False,
    "str": "AdamOptimizer",
    "unicode": "héllo wörld ✓ 日本",
    "empty_str": "",
    "nul_str": "a\x00b",
    "bytes": b"\x00\x01\xff",
    "empty_bytes": b"",
    "none": None,
    "ints": [1, 2, 3],
    "floats": [0.5, -1.0],
    "bools": [True, False],
    "strs": ["a", "é", ""],
    "empty_list": [],
    "tuple": (1, 2),
    "str_tuple": ("x",),
    "empty_tuple": (),
}


def test_python_values_round_trip_with_their_types(tmp_path):
    assert_same(PYTHON_VALUES, roundtrip(tmp_path, PYTHON_VALUES))


def test_empty_dicts_and_awkward_keys_round_trip(tmp_path):
    tree = {
        "empty": {},
        "nested": {"deeper": {}},
        "enc/layer.0/w": torch.ones(2),
        "100%": 1,
        "%2F": 2,
        ".": 3,
        "..": 4,
        "nul\x00key": 5,
        "ключ": {"日本": "x"},
    }
    out = roundtrip(tmp_path, tree)
    assert_same(tree, out)
    with h5py.File(tmp_path / "ckpt.ortcp", "r") as f:
        assert sorted(f.keys()) == sorted(
            ["empty", "nested", "enc%2Flayer.0%2Fw", "100%25", "%252F", "%2E", "..", "nul%00key", "ключ"]
        )


# ---- partial loads -------------------------------------------------------------------------------
LEGACY_SHAPED = {
    "model": {"full_precision": {"fc1.weight": torch.randn(4, 3, generator=g), "fc1.bias": torch.zeros(4)}},
    "optimizer": {
        "fc1.weight": {"Moment_1": torch.zeros(4, 3), "Moment_2": torch.ones(4, 3), "Update_Count": torch.tensor([9])},
        "fc1.bias": {"Moment_1": torch.zeros(4), "Moment_2": torch.ones(4), "Update_Count": torch.tensor([9])},
    },
    "trainer_options": legacy_trainer_options(),
    "train_step_info": {"optimization_step": 8, "step": 8},
}


@pytest.fixture
def legacy_shaped(tmp_path):
    path = tmp_path / "legacy_shaped.ortcp"
    C.save(LEGACY_SHAPED, path)
    return path


def test_partial_load_reads_only_the_subtree(legacy_shaped, monkeypatch):
    read = []
    original = C.CheckpointReader._read_value
    monkeypatch.setattr(
        C.CheckpointReader,
        "_read_value",
        lambda self, node, checks: read.append(node.keypath) or original(self, node, checks),
    )
    assert_same(LEGACY_SHAPED["trainer_options"], C.load(legacy_shaped, "trainer_options"))
    assert read and all(p.startswith("trainer_options/") for p in read)
    assert_same(LEGACY_SHAPED["optimizer"]["fc1.bias"], C.load(legacy_shaped, "optimizer/fc1.bias/"))
    assert_same(
        LEGACY_SHAPED["model"]["full_precision"]["fc1.weight"], C.load(legacy_shaped, "model/full_precision/fc1.weight")
    )
    assert C.load(legacy_shaped, ("trainer_options", "world_size")) == 1


def test_partial_load_of_key_containing_slash(tmp_path):
    C.save({"enc": {"a/b": 1, "a": {"b": 2}}}, tmp_path / "k.ortcp")
    assert C.load(tmp_path / "k.ortcp", ("enc", "a/b")) == 1
    assert C.load(tmp_path / "k.ortcp", "enc/a/b") == 2


def test_missing_key_lists_available_keys(legacy_shaped):
    with pytest.raises(
        KeyError,
        match=r"'trainer_options/nope' not found in .*legacy_shaped.ortcp: trainer_options has keys \['data_par",
    ):
        C.load(legacy_shaped, "trainer_options/nope")
    with pytest.raises(C.CheckpointKeyError, match=r"the root has keys \['model', 'optimizer', 'train_step_info'"):
        C.load(legacy_shaped, "nope")
    with pytest.raises(KeyError, match=r"'train_step_info/step' is a value"):
        C.load(legacy_shaped, "train_step_info/step/x")


# ---- overwrite and crash-safety rules ------------------------------------------------------------
def test_save_refuses_existing_file_without_overwrite(tmp_path):
    path = tmp_path / "c.ortcp"
    C.save({"v": 1}, path)
    with pytest.raises(C.CheckpointExistsError, match=r"c.ortcp already exists; pass overwrite=True"):
        C.save({"v": 2}, path)
    with pytest.raises(FileExistsError):
        C.save({"v": 2}, path)
    assert C.load(path) == {"v": 1}
    C.save({"v": 3}, path, overwrite=True)
    assert C.load(path) == {"v": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ortcp"]


def test_failed_save_leaves_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "c.ortcp"
    C.save({"v": 1}, path)

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(_atomic, "write_header", boom)
    with pytest.raises(C.CheckpointWriteError, match="cannot save .*c.ortcp: disk full .simulated."):
        C.save({"v": 2, "t": torch.ones(1000)}, path, overwrite=True)
    assert C.load(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ortcp"]


def test_bad_targets(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="cannot save .*file/sub/c.ortcp: cannot create its folder"):
        C.save({}, tmp_path / "file" / "sub" / "c.ortcp")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        C.save({}, tmp_path, overwrite=True)


@pytest.mark.processes
def test_cleanup_temp_files(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stray = tmp_path / f".c.ortcp.tmp-{dead.pid}-0123abcd"
    stray.write_bytes(b"partial")
    keep = tmp_path / ".c.ortcp.tmp-notours"
    keep.write_bytes(b"x")
    assert C.cleanup_temp_files(tmp_path, older_than_s=3600) == []
    assert C.cleanup_temp_files(tmp_path) == [stray]
    stray.write_bytes(b"partial")
    C.save({"v": 1}, tmp_path / "c.ortcp")  # a save removes them too
    assert sorted(p.name for p in tmp_path.iterdir()) == [keep.name, "c.ortcp"]


# ---- unsupported content -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tree", "exc", "match"),
    [
        (
            {"user_dict": {"opt": {"foo": {1, 2}}}},
            TypeError,
            r"unsupported value of type builtins.set at 'user_dict/opt/foo'",
        ),
        ({"a": object()}, TypeError, r"builtins.object at 'a'"),
        ({"a": [1, "x"]}, TypeError, r"unsupported list at 'a' with element types \['int', 'str'\]"),
        ({"a": [[1, 2]]}, TypeError, r"unsupported list at 'a' with element types \['list'\]"),
        ({"a": (1, 2.0)}, TypeError, r"unsupported tuple at 'a'"),
        ({"a": 1 + 2j}, TypeError, r"builtins.complex at 'a'"),
        ({"a": {"b": 2**64}}, TypeError, r"integer out of int64 range at 'a/b'"),
        ({"a": np.array(["x"])}, TypeError, r"unsupported numpy dtype <U1 at 'a'"),
        ({"a": np.array([None], dtype=object)}, TypeError, r"unsupported numpy dtype object at 'a'"),
        ({"a": torch.ones(2).to_sparse()}, TypeError, r"only dense strided tensors"),
        ({"a": {3: 1}}, TypeError, r"keys must be str, got int 3 at 'a/3'"),
        ({"a": {"": 1}}, ValueError, r"empty key at 'a/'"),
    ],
)
def test_unsupported_content_names_the_key_path(tmp_path, tree, exc, match):
    with pytest.raises(exc, match=match):
        C.save(tree, tmp_path / "c.ortcp")
    assert not list(tmp_path.iterdir())


def test_non_mapping_and_cyclic_trees(tmp_path):
    with pytest.raises(TypeError, match="must be a Mapping .* got list"):
        C.save([1, 2], tmp_path / "c.ortcp")
    cyclic: dict = {"a": {}}
    cyclic["a"]["self"] = cyclic
    with pytest.raises(ValueError, match="reference cycle at 'a/self'"):
        C.save(cyclic, tmp_path / "c.ortcp")


# ---- opening errors and refused objects ---------------------------------------------------------
def test_open_errors_name_the_file(tmp_path):
    with pytest.raises(C.CheckpointNotFoundError, match=r"nothere.ortcp: no such checkpoint file"):
        C.load(tmp_path / "nothere.ortcp")
    with pytest.raises(FileNotFoundError):
        C.open_checkpoint(tmp_path / "nothere.ortcp")
    (tmp_path / "text.ortcp").write_text("hello")
    with pytest.raises(C.CheckpointFormatError, match=r"text.ortcp is not an HDF5 file"):
        C.load(tmp_path / "text.ortcp")
    with pytest.raises(C.CheckpointFormatError, match=r"is a directory"):
        C.load(tmp_path)


def test_newer_version_and_foreign_format(tmp_path):
    for name, fmt, version in [("new.h5", C.FORMAT_NAME, 7), ("other.h5", "someone.else", 1)]:
        with h5py.File(tmp_path / name, "w") as f:
            f.attrs["ort_trainer.format"], f.attrs["ort_trainer.format_version"] = fmt, version
    with pytest.raises(C.CheckpointVersionError, match=r"new.h5 has checkpoint format version 7, newer .* \(2\)"):
        C.load(tmp_path / "new.h5")
    with pytest.raises(C.CheckpointFormatError, match=r"other.h5: root attribute ort_trainer.format='someone.else'"):
        C.load(tmp_path / "other.h5")


def test_links_external_and_virtual_data_are_refused(tmp_path):
    np.save(tmp_path / "raw.npy", np.zeros(4))
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.arange(4.0)
    cases = {
        "ext_link.h5": lambda f: f.__setitem__("w", h5py.ExternalLink("other.h5", "/x")),
        "soft_link.h5": lambda f: (f.__setitem__("x", np.ones(2)), f.__setitem__("w", h5py.SoftLink("/x"))),
        "ext_storage.h5": lambda f: f.create_dataset(
            "w", shape=(4,), dtype="f8", external=[(str(tmp_path / "raw.npy"), 0, 32)]
        ),
        "virtual.h5": lambda f: f.create_virtual_dataset("w", _layout(tmp_path / "other.h5")),
    }
    for name, build in cases.items():
        with h5py.File(tmp_path / name, "w") as f:
            f.create_group("model")
            build(f["model"])
    expected = {
        "ext_link.h5": "external link '/model/w' -> other.h5:/x",
        "soft_link.h5": "soft/user link '/model/w' -> /x",
        "ext_storage.h5": "dataset '/model/w' with external storage",
        "virtual.h5": "virtual dataset '/model/w'",
    }
    for name, message in expected.items():
        with pytest.raises(C.CheckpointFormatError, match=f"{name}: refusing {message}".replace("(", r"\(")):
            C.load(tmp_path / name)


def _layout(source):
    layout = h5py.VirtualLayout(shape=(4,), dtype="f8")
    layout[:] = h5py.VirtualSource(source, "x", shape=(4,))
    return layout


# ---- reader API ----------------------------------------------------------------------------------
def test_reader_inspects_without_loading(legacy_shaped):
    with C.open_checkpoint(legacy_shaped) as reader:
        assert reader.format_version == C.FORMAT_VERSION and not reader.is_legacy
        assert reader.attrs["ort_trainer.format"] == C.FORMAT_NAME
        assert reader.keys() == ["model", "optimizer", "train_step_info", "trainer_options"]
        assert reader.keys("optimizer/fc1.bias") == ["Moment_1", "Moment_2", "Update_Count"]
        info = reader.tree_info()
        assert info["model"]["full_precision"]["fc1.weight"] == C.DatasetInfo((4, 3), torch.float32)
        assert info["optimizer"]["fc1.bias"]["Update_Count"] == ((1,), torch.int64)
        assert info["trainer_options"]["optimizer_name"] == ((), str)
        assert reader.tree_info("train_step_info/step") == ((), int)
        walked = [key for key, _ in reader.walk("optimizer")]
        assert walked[:2] == [("optimizer", "fc1.bias", "Moment_1"), ("optimizer", "fc1.bias", "Moment_2")]
        assert "trainer_options/zero_stage" in reader and "trainer_options/x" not in reader
        assert reader.verify() == 17 and reader.verify("optimizer") == 6


def test_read_into_fills_existing_buffer(tmp_path):
    flat = torch.zeros(20, dtype=torch.bfloat16)
    src = torch.randn(20, generator=g).bfloat16()
    C.save({"w": src, "n": 1}, tmp_path / "c.ortcp")
    with C.open_checkpoint(tmp_path / "c.ortcp") as reader:
        assert reader.read_into("w", flat[:20]) is not None
        assert torch.equal(flat, src)
        with pytest.raises(
            ValueError, match=r"stored shape \(20,\) dtype torch.bfloat16, got shape \(10,\) dtype torch.bfloat16"
        ):
            reader.read_into("w", flat[:10])
        with pytest.raises(ValueError, match="got shape .* dtype torch.float32"):
            reader.read_into("w", torch.zeros(20))
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            reader.read_into("w", torch.zeros(40, dtype=torch.bfloat16)[::2])
        with pytest.raises(ValueError, match="'n' is not array data"):
            reader.read_into("n", torch.zeros(()))


def test_data_damage_detected_by_checksum(tmp_path):
    path = tmp_path / "c.ortcp"
    C.save({"model": {"w": torch.arange(1000, dtype=torch.float32)}}, path)
    with h5py.File(path, "r") as f:
        offset = f["model/w"].id.get_offset()
    data = bytearray(path.read_bytes())
    data[offset + 100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(C.CheckpointCorruptError, match=r"c.ortcp: checksum mismatch in 1 dataset\(s\): \[\"'/model/w'"):
        C.load(path)
    with C.open_checkpoint(path) as reader, pytest.raises(C.CheckpointCorruptError, match="'/model/w'"):
        reader.verify()
    assert C.load(path, verify=False)["model"]["w"][25] != 25  # verify=False skips all checks


# ---- golden layout -------------------------------------------------------------------------------
GOLDEN = {  # HDF5 path -> (dtype, shape, py_type)
    "model/full_precision/fc1.bias": ("<f4", (4,), "tensor"),
    "model/full_precision/fc1.weight": ("<f4", (4, 3), "tensor"),
    "optimizer/fc1.bias/Moment_1": ("<f4", (4,), "tensor"),
    "optimizer/fc1.bias/Moment_2": ("<f4", (4,), "tensor"),
    "optimizer/fc1.bias/Update_Count": ("<i8", (1,), "tensor"),
    "optimizer/fc1.weight/Moment_1": ("<f4", (4, 3), "tensor"),
    "optimizer/fc1.weight/Moment_2": ("<f4", (4, 3), "tensor"),
    "optimizer/fc1.weight/Update_Count": ("<i8", (1,), "tensor"),
    "train_step_info/optimization_step": ("<i8", (), "int"),
    "train_step_info/step": ("<i8", (), "int"),
    "trainer_options/data_parallel_size": ("<i8", (), "int"),
    "trainer_options/horizontal_parallel_size": ("<i8", (), "int"),
    "trainer_options/mixed_precision": ("|b1", (), "bool"),
    "trainer_options/optimizer_name": ("|O", (), "str"),
    "trainer_options/world_rank": ("<i8", (), "int"),
    "trainer_options/world_size": ("<i8", (), "int"),
    "trainer_options/zero_stage": ("<i8", (), "int"),
}


def test_golden_layout(legacy_shaped):
    raw = legacy_shaped.read_bytes()
    assert raw[:8] == b"ORTCKPT\x00"
    with h5py.File(legacy_shaped, "r") as f:
        assert f.userblock_size == 512
        assert sorted(f.attrs.keys()) == [
            "ort_trainer.format",
            "ort_trainer.format_version",
            "ort_trainer.library_version",
            "ort_trainer.tree_crc32",
        ]
        assert (f.attrs["ort_trainer.format"], f.attrs["ort_trainer.format_version"]) == ("ort_trainer.checkpoint", 2)
        assert isinstance(f.attrs["ort_trainer.library_version"], str)
        assert f.attrs["ort_trainer.tree_crc32"].dtype == np.uint32
        layout = {}
        f.visititems(lambda name, obj: layout.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
        assert sorted(layout) == sorted(GOLDEN)
        for name, (dtype, shape, py_type) in GOLDEN.items():
            ds = layout[name]
            assert (ds.dtype.str, ds.shape, ds.attrs["py_type"]) == (dtype, shape, py_type), name
            assert sorted(ds.attrs.keys()) == ["crc32c", "py_type"], name
            assert ds.chunks is None and ds.compression is None, name
            raw = ds.asstr()[()].encode() if dtype == "|O" else ds[()].tobytes()
            assert ds.attrs["crc32c"] == google_crc32c.value(raw), name
        assert f["optimizer/fc1.bias/Update_Count"][()].tolist() == [9]
        assert f["trainer_options/optimizer_name"][()] == b"AdamOptimizer"  # what legacy readers get


# ---- memory --------------------------------------------------------------------------------------
MEMORY_PROBE = """
import resource, sys, torch, checkpoint
state = {f"w{i}": torch.randn(2_000_000) for i in range(16)}  # 128 MB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
checkpoint.save(state, sys.argv[1])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.processes
def test_save_peak_extra_memory_is_small(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "m.ortcp")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.split()[-1])
    assert extra < 0.10 * 128e6, f"save used {extra / 1e6:.1f} MB extra for a 128 MB state"
