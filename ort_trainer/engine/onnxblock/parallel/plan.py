"""Which layers a Megatron run splits: a list of blocks, each column-parallel layer(s) + one row-parallel layer.

A block is the Megatron pair: the column-parallel first projection(s) (an MLP's fc1, attention's
QKV: one fused layer or three) and the row-parallel second one (fc2, the attention out-projection).
Blocks are found from the module tree (Hugging Face GPT-2 and BERT style attention and MLP blocks, and
any module with ``fc1``/``fc2`` Linear children) or given by the user in
``options.distributed.horizontal_parallel_blocks``: a list of ``(columns, row)`` pairs of module names
or ``fnmatch`` patterns (``columns`` a name/pattern or a tuple of them), e.g.
``[("*.mlp.c_fc", "*.mlp.c_proj")]``. Every check names the block that cannot be split.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SplitBlock", "find_blocks"]

_QKV_STRIDE = 3  # GPT-2's fused c_attn holds Q, K and V side by side


@dataclass(frozen=True)
class SplitBlock:
    """One Megatron block: ``columns`` split on their outputs, ``row`` on its inputs."""

    columns: tuple[str, ...]
    row: str
    strides: tuple[int, ...] = ()  # per column layer: blocks side by side in its output (fused QKV: 3)
    heads: str | None = None  # attention module whose head bookkeeping is divided by h

    def stride(self, column: str) -> int:
        return self.strides[self.columns.index(column)] if self.strides else 1

    def describe(self) -> str:
        return f"block (columns {list(self.columns)}, row {self.row!r})"


def find_blocks(model: torch.nn.Module, given: Sequence = ()) -> list[SplitBlock]:
    """The blocks to split: ``given`` (names or patterns) expanded, else those found in the module tree."""
    modules = dict(model.named_modules())
    blocks = _expand(given, modules) if given else _detect(modules)
    if not blocks:
        raise ValueError(
            "horizontal_parallel_size > 1, but no block to split was found in the model: give "
            "options.distributed.horizontal_parallel_blocks=[(column_module, row_module), ...] (module names or "
            "fnmatch patterns); found automatically: GPT-2 / BERT attention and MLP blocks, fc1/fc2 MLPs"
        )
    for block in blocks:
        _check_kinds(block, modules)
    return blocks


def _detect(modules: dict[str, torch.nn.Module]) -> list[SplitBlock]:
    blocks = []
    for name, module in modules.items():
        prefix = f"{name}." if name else ""
        kind = type(module).__name__
        if hasattr(module, "c_attn") and hasattr(module, "c_proj") and hasattr(module, "split_size"):
            blocks.append(SplitBlock((f"{prefix}c_attn",), f"{prefix}c_proj", (_QKV_STRIDE,), name))
        elif hasattr(module, "c_fc") and hasattr(module, "c_proj"):
            blocks.append(SplitBlock((f"{prefix}c_fc",), f"{prefix}c_proj"))
        elif all(hasattr(getattr(module, "self", None), n) for n in ("query", "key", "value")) and hasattr(
            getattr(module, "output", None), "dense"
        ):
            columns = tuple(f"{prefix}self.{n}" for n in ("query", "key", "value"))
            blocks.append(SplitBlock(columns, f"{prefix}output.dense", (), f"{prefix}self"))
        elif hasattr(getattr(module, "intermediate", None), "dense") and hasattr(
            getattr(module, "output", None), "dense"
        ):
            blocks.append(SplitBlock((f"{prefix}intermediate.dense",), f"{prefix}output.dense"))
        elif (
            kind != "Sequential"
            and _is_linear(getattr(module, "fc1", None))
            and _is_linear(getattr(module, "fc2", None))
        ):
            blocks.append(SplitBlock((f"{prefix}fc1",), f"{prefix}fc2"))
    return blocks


def _expand(given: Sequence, modules: dict[str, torch.nn.Module]) -> list[SplitBlock]:
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise TypeError(f"horizontal_parallel_blocks must be a list of (columns, row) pairs, got {given!r}")
    blocks = []
    for pair in given:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and isinstance(pair[1], str)):
            raise TypeError(f"horizontal_parallel_blocks: each entry must be a (columns, row) pair, got {pair!r}")
        column_patterns = (pair[0],) if isinstance(pair[0], str) else tuple(pair[0])
        rows = _matches(pair[1], modules)
        columns = [_matches(p, modules) for p in column_patterns]
        if any(len(c) != len(rows) for c in columns):
            raise ValueError(
                f"horizontal_parallel_blocks entry {pair!r}: the patterns match different numbers of modules "
                f"(columns {[len(c) for c in columns]}, row {len(rows)})"
            )
        for i, row in enumerate(rows):
            blocks.append(SplitBlock(tuple(c[i] for c in columns), row))
    return blocks


def _matches(pattern: str, modules: dict[str, torch.nn.Module]) -> list[str]:
    names = [pattern] if pattern in modules else sorted(n for n in modules if n and fnmatch.fnmatchcase(n, pattern))
    if not names:
        raise ValueError(f"horizontal_parallel_blocks: {pattern!r} names no module of the model")
    return names


def _is_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _check_kinds(block: SplitBlock, modules: dict[str, torch.nn.Module]) -> None:
    for name in (*block.columns, block.row):
        if not _is_linear(modules.get(name)):
            kind = type(modules.get(name)).__name__
            raise ValueError(
                f"cannot split {block.describe()}: {name!r} is a {kind}, but only torch.nn.Linear and "
                "transformers' Conv1D layers can be split"
            )
