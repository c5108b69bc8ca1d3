"""``manifest.json``: what a runtime needs to drive a training artifact (docs/anywhere.md, "Artifact format").

`read_manifest` checks every key a driver relies on (types, names, file names that stay inside the folder) and
says which key of which file is wrong; it only parses JSON, nothing in the file is executed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._errors import ArtifactError
from ._state_file import FORMAT

__all__ = ["MANIFEST", "ROLES", "VERSION", "read_manifest", "shape_entry", "write_manifest"]

MANIFEST = "manifest.json"
VERSION = 1
ROLES = ("parameter", "buffer", "optimizer")
_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
_DIM = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_MAX_MANIFEST = 64 * 1024 * 1024


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def shape_entry(dim: int | str, dims: list[str]) -> int | str:
    """A shape entry as the manifest writes it: an int, a dim name, or a product ``"batch*seq*4"`` of dim names
    and ints; ValueError for any other expression (a sum of dims has no entry in the format)."""
    if isinstance(dim, int):
        return dim
    text = str(dim).replace(" ", "")
    factors = text.split("*")
    if not all(f.isdigit() or f in dims for f in factors):
        raise ValueError(f"the size {dim!r} is not a product of the dims {dims} and integers")
    return text


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the artifact in ``folder``, with every key a driver needs checked (`ArtifactError`)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest (is {folder} a folder written by ort_trainer.export_training?)")
    if path.stat().st_size > _MAX_MANIFEST:
        raise ArtifactError(f"{path}: {path.stat().st_size:,} bytes, more than a manifest can be ({_MAX_MANIFEST:,})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(f"{path}: not JSON ({error})") from None
    _Checker(path, manifest).check()
    return manifest


class _Checker:
    def __init__(self, path: Path, manifest: Any):
        self.path, self.manifest = path, manifest

    def fail(self, key: str, message: str) -> None:
        raise ArtifactError(f"{self.path}: {key}: {message}")

    def get(self, mapping: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        name = f"{where}{key}"
        if not isinstance(mapping, dict) or key not in mapping:
            self.fail(name, "missing")
        value = mapping[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            self.fail(name, f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
        return value

    def check(self) -> None:
        m = self.manifest
        if not isinstance(m, dict):
            self.fail("(top)", f"expected an object, got {type(m).__name__}")
        if m.get("format") != FORMAT:
            self.fail("format", f"expected {FORMAT!r}, got {m.get('format')!r}")
        if m.get("version") != VERSION:
            self.fail("version", f"this ort_trainer reads version {VERSION}, got {m.get('version')!r}")
        files = self.get(m, "files", dict)
        for key in ("train", "eval", "state"):
            name = self.get(files, key, str, "files.")
            if "/" in name or "\\" in name or name in ("", ".", ".."):
                self.fail(f"files.{key}", f"expected a file name inside the artifact folder, got {name!r}")
        dims = self.get(m, "dims", list)
        if not all(isinstance(d, str) and _DIM.match(d) for d in dims):
            self.fail("dims", f"expected names of dims, got {dims!r}")
        for i, entry in enumerate(self.get(m, "inputs", list)):
            self.tensor(entry, f"inputs[{i}].", dims)
        for i, entry in enumerate(self.get(m, "state", list)):
            self.tensor(entry, f"state[{i}].", [])
            if entry.get("role") not in ROLES:
                self.fail(f"state[{i}].role", f"expected one of {list(ROLES)}, got {entry.get('role')!r}")
        for i, entry in enumerate(self.get(m, "random", list)):
            self.tensor(entry, f"random[{i}].", dims)
            if entry.get("kind") not in ("uniform", "normal"):
                self.fail(f"random[{i}].kind", f"expected 'uniform' or 'normal', got {entry.get('kind')!r}")
        step = self.get(m, "step", int)
        if step < 0:
            self.fail("step", f"expected an integer >= 0, got {step}")
        self.graphs(m)

    def graphs(self, m: dict[str, Any]) -> None:
        train = self.get(m, "train", dict)
        names = self.get(train, "inputs", list, "train.")
        if not all(isinstance(n, str) for n in names):
            self.fail("train.inputs", "expected a list of input names")
        scalars = self.get(train, "scalars", dict, "train.")
        if scalars != {"lr": "float32", "step": "int64"}:
            self.fail("train.scalars", f'expected {{"lr": "float32", "step": "int64"}}, got {scalars!r}')
        self.get(train, "loss", str, "train.")
        updated = self.get(train, "updated", dict, "train.")
        state = {e["name"] for e in m["state"]}
        unknown = sorted(set(updated) - state)
        if unknown:
            self.fail("train.updated", f"names {unknown[:10]} that are not state tensors")
        evaluation = self.get(m, "eval", dict)
        self.get(evaluation, "inputs", list, "eval.")
        self.get(evaluation, "outputs", list, "eval.")

    def tensor(self, entry: Any, where: str, dims: list[str]) -> None:
        self.get(entry, "name", str, where)
        dtype = self.get(entry, "dtype", str, where)
        if dtype not in _DTYPES:
            self.fail(f"{where}dtype", f"expected one of {list(_DTYPES)}, got {dtype!r}")
        shape = self.get(entry, "shape", list, where)
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int | str):
                self.fail(f"{where}shape", f"expected ints or dim names, got {shape!r}")
            if isinstance(dim, int) and dim < 0:
                self.fail(f"{where}shape", f"a negative size in {shape!r}")
            if isinstance(dim, str):
                try:
                    shape_entry(dim, dims)
                except ValueError:
                    self.fail(f"{where}shape", f"{dim!r} is not a size, a dim of {dims} or a product of them")
