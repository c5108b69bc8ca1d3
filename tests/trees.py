"""Compare nested state trees exactly (tensors bit for bit, other values with ==)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def assert_trees_equal(a, b, path: str = "state") -> None:
    """Same keys everywhere, tensors equal bit for bit (dtype and shape included), other values equal."""
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{path}: a mapping vs {type(b).__name__}"
        assert set(a) == set(b), f"{path}: keys differ: {sorted(set(a) ^ set(b), key=str)}"
        for key in a:
            assert_trees_equal(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, torch.Tensor | np.ndarray):
        ta, tb = torch.as_tensor(a), torch.as_tensor(b)
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, (
            f"{path}: {ta.dtype}{tuple(ta.shape)} vs {tb.dtype}{tuple(tb.shape)}"
        )
        assert torch.equal(ta, tb), f"{path} differs (max {float((ta.double() - tb.double()).abs().max())})"
    elif isinstance(a, list | tuple) and any(
        isinstance(x, list | tuple | Mapping | torch.Tensor | np.ndarray) for x in a
    ):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a).__name__} of {len(a)} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_trees_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def tree_structure(tree):
    """Keys, shapes and dtypes of a tree (values dropped), to compare layouts."""
    if isinstance(tree, Mapping):
        return {k: tree_structure(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype)
    return type(tree).__name__
