"""A ``ZeroRedundancyOptimizer``'s shard, and the full optimizer state its shards make.

Each rank's ZeRO optimizer holds the state of the parameters it owns, in a local optimizer that numbers
them locally. Saving, each rank maps its local state to the **global** parameter index (the position of
the parameter in the ZeRO optimizer's ``param_groups``, the numbering of ``consolidate_state_dict`` and of
any torch optimizer's ``state_dict()``) and writes it under ``optimizer/<name>.<index>`` of its own file:
the set's aggregation then unites the shards like the ZeRO pieces of our trainer (each parameter is on one
rank). The union plus the (replicated) ``param_groups`` is exactly ``ZeroRedundancyOptimizer.state_dict()``
after a consolidation, and exactly a plain optimizer's ``state_dict()``: it loads into a ZeRO optimizer at
any world size (``ZeroRedundancyOptimizer.load_state_dict`` keeps what the new rank owns) and into a plain
optimizer. No collective is needed to save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["full_optimizer_state", "shard_key", "split_shard_key", "zero_shard"]


def shard_key(name: str, index: int) -> str:
    """``<name>.<global parameter index>``: the ``optimizer/`` group of one parameter of optimizer ``name``."""
    return f"{name}.{index}"


def split_shard_key(key: str) -> tuple[str, int] | None:
    """(name, index) of a :func:`shard_key`, or None if ``key`` is not one."""
    name, _, index = key.rpartition(".")
    return (name, int(index)) if name and index.isdigit() and index.isascii() else None


def _groups(optimizer: Any) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """``param_groups`` with global indices in place of the parameters (as ``Optimizer.state_dict()`` packs
    them), and {id(param): global index}."""
    index: dict[int, int] = {}
    groups = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            index.setdefault(id(param), len(index))
        packed = {key: value for key, value in group.items() if key != "params"}
        packed["params"] = [index[id(p)] for p in group["params"]]
        groups.append(packed)
    return groups, index


def zero_shard(zero: Any) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """(global param_groups, {global index: per-parameter state}) of this rank's shard of ``zero``.

    A ZeRO optimizer's own groups hold only the hyperparameters it was given (``lr=...``); the local
    optimizer's group ``i`` (one per global group on every rank) has the optimizer class's full set (``betas``,
    ``eps``, ...). The groups saved are both merged, the ZeRO optimizer's values winning (an LR scheduler sets
    those), so that the state also loads into a plain optimizer of that class.
    """
    groups, index = _groups(zero)
    for group, local_group in zip(groups, zero.optim.param_groups, strict=True):
        for key, value in local_group.items():
            if key != "params":
                group.setdefault(key, value)
    local = zero.optim.state_dict()
    local_params = [p for group in zero.optim.param_groups for p in group["params"]]
    return groups, {index[id(local_params[i])]: value for i, value in local["state"].items()}


def full_optimizer_state(param_groups: Any, shards: Mapping[int, Any]) -> dict[str, Any]:
    """The whole ``state_dict()`` from the param_groups and the united per-parameter states."""
    return {"state": {index: shards[index] for index in sorted(shards)}, "param_groups": param_groups}
