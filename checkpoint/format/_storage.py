"""The small storage interface the trainer talks to, with an HDF5 and an in-memory implementation."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import CheckpointExistsError, CheckpointKeyError, CheckpointNotFoundError
from . import schema as S
from ._codec import decode_python_value, encode_leaf, leaf_array
from ._h5_reader import Key, load, split_key
from ._h5_writer import plan_tree, save
from .lazy_torch import torch

__all__ = ["CheckpointStorage", "HDF5Storage", "InMemoryStorage"]

PathLike = str | os.PathLike[str]


@runtime_checkable
class CheckpointStorage(Protocol):
    """Where checkpoint trees live.

    Call order: ``write(tree, path)`` publishes a whole tree atomically (refusing an existing
    ``path`` unless ``overwrite``); ``read(path, key)`` returns it or one subtree, any number of
    times; ``exists(path)`` and ``remove(path)`` manage files. Values come back in load form:
    arrays as CPU tensors, python values as themselves.
    """

    def write(self, tree: Mapping[str, Any], path: PathLike, *, overwrite: bool = False) -> None: ...

    def read(self, path: PathLike, key: Key = None) -> Any: ...

    def exists(self, path: PathLike) -> bool: ...

    def remove(self, path: PathLike) -> None: ...


class HDF5Storage:
    """Checkpoints as HDF5 files (``save`` / ``load``)."""

    def __init__(self, *, verify: bool = True) -> None:
        self.verify = verify

    def write(self, tree: Mapping[str, Any], path: PathLike, *, overwrite: bool = False) -> None:
        save(tree, path, overwrite=overwrite)

    def read(self, path: PathLike, key: Key = None) -> Any:
        return load(path, key, verify=self.verify)

    def exists(self, path: PathLike) -> bool:
        return Path(os.fspath(path)).is_file()

    def remove(self, path: PathLike) -> None:
        try:
            Path(os.fspath(path)).unlink()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{os.fspath(path)}: no such checkpoint file") from None


def _as_loaded(value: Any) -> Any:
    """A private copy of ``value`` as ``load`` would return it (tensors for array data)."""
    if isinstance(value, Mapping):
        return {key: _as_loaded(item) for key, item in value.items()}
    leaf = encode_leaf(value, "")
    py_type = leaf.attrs[S.ATTR_PY_TYPE]
    if py_type == S.PY_TENSOR:
        return value.detach().to("cpu", copy=True).contiguous()
    if py_type in (S.PY_NDARRAY, S.PY_NUMPY_SCALAR):
        return torch.from_numpy(np.array(leaf_array(leaf), copy=True))
    data = leaf_array(leaf)
    return decode_python_value(py_type, None if py_type == S.PY_NONE else data)


class InMemoryStorage:
    """Checkpoints kept in a dict (for tests): same validation, errors and load form as HDF5."""

    def __init__(self) -> None:
        self.trees: dict[str, dict[str, Any]] = {}

    def write(self, tree: Mapping[str, Any], path: PathLike, *, overwrite: bool = False) -> None:
        plan_tree(tree)  # same TypeError/ValueError as the HDF5 writer
        name = os.fspath(path)
        if name in self.trees and not overwrite:
            raise CheckpointExistsError(f"{name} already exists; pass overwrite=True to replace it")
        self.trees[name] = _as_loaded(tree)

    def read(self, path: PathLike, key: Key = None) -> Any:
        name = os.fspath(path)
        if name not in self.trees:
            raise CheckpointNotFoundError(f"{name}: no such checkpoint file")
        node: Any = self.trees[name]
        parts = split_key(key)
        for depth, part in enumerate(parts):
            where = "/".join(parts[:depth]) or "the root"
            if not isinstance(node, dict) or part not in node:
                found = sorted(node) if isinstance(node, dict) else "a value"
                raise CheckpointKeyError(f"'{'/'.join(parts)}' not found in {name}: {where} has keys {found}")
            node = node[part]
        return copy.deepcopy(node)

    def exists(self, path: PathLike) -> bool:
        return os.fspath(path) in self.trees

    def remove(self, path: PathLike) -> None:
        if self.trees.pop(os.fspath(path), None) is None:
            raise CheckpointNotFoundError(f"{os.fspath(path)}: no such checkpoint file")
