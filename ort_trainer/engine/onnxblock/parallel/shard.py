"""Slicing a model for one rank of a horizontal group (Megatron-LM ``tensor_parallel/layers.py``).

``shard_model`` returns a copy of the model in which every block of the plan is replaced by this
rank's slice: column-parallel layers keep ``1/h`` of their outputs (for a fused QKV layer, ``1/h``
of each of Q, K and V: whole heads), row-parallel layers ``1/h`` of their inputs, with the bias added
once, after the sum over the group. Parameter names do not change, so state dicts, optimizer groups
and checkpoints speak the same names as a single-process run. `PartitionSpec` says how each sliced
parameter relates to the full one (and gives the legacy ``megatron_row_partition`` flag).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .markers import copy_to_parallel, reduce_from_parallel
from .plan import SplitBlock

__all__ = ["ColumnParallelLinear", "PartitionSpec", "RowParallelLinear", "shard_model"]

_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head")
_HEAD_WIDTHS = ("split_size", "all_head_size")


@dataclass(frozen=True)
class PartitionSpec:
    """A parameter split across the ``h`` ranks along ``axis``, in ``stride`` side-by-side blocks."""

    full_shape: tuple[int, ...]
    axis: int
    stride: int = 1

    @property
    def row_partition_flag(self) -> int:
        """Legacy ``megatron_row_partition``: 1 splits axis 0 of a matrix, 0 the last axis."""
        return 1 if self.axis == 0 and len(self.full_shape) > 1 else 0

    def take(self, full: torch.Tensor, h: int, rank: int) -> torch.Tensor:
        """This rank's slice of the full tensor (a copy)."""
        blocks = full.chunk(self.stride, dim=self.axis)
        return torch.cat([b.chunk(h, dim=self.axis)[rank] for b in blocks], dim=self.axis).clone()

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order."""
        pieces = [s.chunk(self.stride, dim=self.axis) for s in shards]
        return torch.cat([p[b] for b in range(self.stride) for p in pieces], dim=self.axis)


class ColumnParallelLinear(torch.nn.Module):
    """y = f(x) @ W_r + b_r: this rank's outputs of a Linear / Conv1D (``transposed``: weight is [in, out])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
        super().__init__()
        self.transposed = transposed
        self.weight = torch.nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(copy_to_parallel(x), self.weight if self.transposed else self.weight.t())
        return y if self.bias is None else y + self.bias


class RowParallelLinear(torch.nn.Module):
    """y = g(x_r @ W_r) + b: partial products summed over the group, the (replicated) bias added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
        super().__init__()
        self.transposed = transposed
        self.weight = torch.nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(torch.matmul(x, self.weight if self.transposed else self.weight.t()))
        return y if self.bias is None else y + self.bias


def shard_model(
    model: torch.nn.Module, blocks: Sequence[SplitBlock], h: int, rank: int
) -> tuple[torch.nn.Module, dict[str, PartitionSpec]]:
    """A copy of ``model`` holding rank ``rank``'s slices, and ``{parameter name: PartitionSpec}``."""
    sharded = copy.deepcopy(model)
    modules = dict(sharded.named_modules())
    specs: dict[str, PartitionSpec] = {}
    for block in blocks:
        _check_block(block, modules, h)
        for name in block.columns:
            specs.update(_replace(sharded, modules, name, ColumnParallelLinear, block.stride(name), h, rank))
        specs.update(_replace(sharded, modules, block.row, RowParallelLinear, 1, h, rank))
        if block.heads is not None:
            _divide_heads(modules[block.heads], h)
    return sharded, specs


def _replace(root, modules, name: str, kind, stride: int, h: int, rank: int) -> dict[str, PartitionSpec]:
    layer = modules[name]
    transposed = not isinstance(layer, torch.nn.Linear)  # transformers' Conv1D: weight [in, out]
    out_axis, in_axis = (1, 0) if transposed else (0, 1)
    weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    specs = {}
    if kind is ColumnParallelLinear:
        specs[f"{name}.weight"] = PartitionSpec(tuple(weight.shape), out_axis, stride)
        if bias is not None:
            specs[f"{name}.bias"] = PartitionSpec(tuple(bias.shape), 0, stride)
    else:
        specs[f"{name}.weight"] = PartitionSpec(tuple(weight.shape), in_axis)
    new_weight = specs[f"{name}.weight"].take(weight, h, rank).requires_grad_(layer.weight.requires_grad)
    if bias is not None:
        bias_spec = specs.get(f"{name}.bias")
        bias = (bias_spec.take(bias, h, rank) if bias_spec else bias.clone()).requires_grad_(layer.bias.requires_grad)
    parent_name, _, child = name.rpartition(".")
    setattr(modules[parent_name] if parent_name else root, child, kind(new_weight, bias, transposed))
    return specs


def _check_block(block: SplitBlock, modules, h: int) -> None:
    for name in block.columns:
        layer = modules[name]
        out = layer.weight.shape[1 if not isinstance(layer, torch.nn.Linear) else 0]
        if out % (h * block.stride(name)):
            raise ValueError(
                f"cannot split {block.describe()}: {name!r} has {out} outputs, not divisible by "
                f"horizontal_parallel_size={h}"
                + (f" x {block.stride(name)} fused parts" if block.stride(name) > 1 else "")
            )
    row = modules[block.row]
    width = row.weight.shape[0 if not isinstance(row, torch.nn.Linear) else 1]
    if width % h:
        raise ValueError(
            f"cannot split {block.describe()}: {block.row!r} has {width} inputs, not divisible by "
            f"horizontal_parallel_size={h}"
        )
    if block.heads is not None:
        heads = [getattr(modules[block.heads], a) for a in _HEAD_COUNTS if hasattr(modules[block.heads], a)]
        if any(n % h for n in heads):
            raise ValueError(
                f"cannot split {block.describe()}: attention {block.heads!r} has {heads[0]} heads, not divisible "
                f"by horizontal_parallel_size={h}"
            )


def _divide_heads(attention: torch.nn.Module, h: int) -> None:
    """Each rank computes n_heads/h whole heads (the views in HF attention infer the head count)."""
    for attr in (*_HEAD_COUNTS, *_HEAD_WIDTHS):
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, getattr(attention, attr) // h)
