"""Combine the per-rank states of a ZeRO and/or Megatron run into one full state, and back.

The logic is pure (over in-memory rank states: :func:`aggregate_states`, :func:`reshard_state`);
the file functions open every rank file, validate the set from its small metadata before any
tensor is read, and run the same plan. :func:`aggregate_to_file` streams: it holds about two
tensors at a time, not the model. Rules (reference §3.2, fixing §11): ranks cover 0..W-1 exactly
once with the same topology, optimizer, precision, run id and step; rank = d*H + h; ZeRO pieces
are placed by their ``offset`` and must tile the tensor; Megatron slices are concatenated in
``h`` order (column partitions on the last axis, row partitions on axis 0); every other value
must be bit-identical on the ranks holding it. ``train_step_info``, ``lr_scheduler`` and
``loss_scaler`` are kept; ``user_dict`` and ``stateful`` are rank 0's, and every rank's own are kept
under ``rank_user_dicts/<r>`` and ``rank_stateful/<r>`` (ranks save different data loader positions).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format import CheckpointReader, open_checkpoint, save_stream
from ..format.lazy_torch import torch
from ..format.schema import MANIFEST_SUFFIX
from ._assemble import assemble, build_tree, leaf_count
from ._manifest import Manifest, check_manifest, is_manifest
from ._partition import Plan, plan_aggregation
from ._rankset import AggregationError, RankSource, StateSource, read_rank_set
from ._zero import reshard_state

__all__ = ["AggregationError", "aggregate_checkpoints", "aggregate_states", "aggregate_to_file", "reshard_state"]

PathLike = str | os.PathLike[str]
Key = tuple[str, ...]


def aggregate_states(states: Sequence[Mapping[str, Any]], *, pytorch_format: bool = False) -> dict[str, Any]:
    """The full single-process state of a distributed save, from all its rank states (any order).

    Each state is what ``checkpoint.load`` returns for one rank's file. The result has ``model``,
    ``optimizer``, ``trainer_options`` (world_rank 0, world_size 1, zero_stage 0, D = H = 1),
    ``train_step_info`` and the other groups; ``pytorch_format=True`` gives ``{name: tensor}`` of
    the model weights only. New tensors are returned (nothing aliases the inputs).

    Raises AggregationError (a ValueError) naming every offending key and rank.
    """
    if isinstance(states, Mapping | str):
        raise TypeError(f"states must be a sequence of rank state dicts, got {type(states).__name__}")
    states = list(states)
    bad = [i for i, s in enumerate(states) if not isinstance(s, Mapping)]
    if bad:
        raise TypeError(f"states must be a sequence of rank state dicts; items {bad} are not mappings")
    sources = [StateSource(state, f"states[{i}]") for i, state in enumerate(states)]
    plan = plan_aggregation(read_rank_set(sources))
    return build_tree(assemble(plan, pytorch_format=pytorch_format))


class FileSource:
    """A rank state in an open checkpoint file (reads only what is asked for)."""

    def __init__(self, reader: CheckpointReader, label: str) -> None:
        self.reader, self.label = reader, label

    def has(self, key: Key) -> bool:
        return key in self.reader

    def tree(self) -> Mapping[str, Any]:
        return self.reader.tree_info()

    def read(self, key: Key) -> Any:
        return self.reader.read(key)

    def read_into(self, key: Key, out: torch.Tensor) -> None:
        self.reader.read_into(key, out)


def _resolve(paths: PathLike | Sequence[PathLike]) -> tuple[list[Path], Manifest | None]:
    """Rank file paths, from a list of paths or a manifest (alone, or as a one-item list; completeness checked)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files = [Path(os.fspath(p)) for p in paths]
    if not files:
        raise AggregationError("no checkpoint files given: pass every rank's file (or the manifest)")
    if len(files) == 1 and is_manifest(files[0]):
        manifest = check_manifest(files[0], checksums=False)
        return manifest.rank_paths(), manifest
    if manifests := [str(p) for p in files if p.name.endswith(MANIFEST_SUFFIX)]:
        raise AggregationError(f"a manifest stands for a whole set: pass it alone, not with other files ({manifests})")
    missing = sorted(str(p) for p in files if not p.is_file())
    if missing:
        raise CheckpointNotFoundError(f"{len(missing)} rank checkpoint file(s) do not exist: {missing}")
    return files, None


@contextmanager
def _open_set(paths: PathLike | Sequence[PathLike]) -> Iterator[Plan]:
    """Open every rank file, validate the set (metadata only), plan; close the files on exit."""
    files, manifest = _resolve(paths)
    with ExitStack() as stack:
        names = [p.name for p in files]
        labels = names if len(set(names)) == len(names) else [str(p) for p in files]
        sources: list[RankSource] = [
            FileSource(stack.enter_context(open_checkpoint(p)), label) for p, label in zip(files, labels, strict=True)
        ]
        rank_set = read_rank_set(sources)
        if manifest is not None and manifest.run_id != rank_set.run_id:
            raise AggregationError(
                f"{manifest.path} is for run_id {manifest.run_id!r} but its files hold run_id {rank_set.run_id!r}"
            )
        yield plan_aggregation(rank_set)


def aggregate_checkpoints(paths: PathLike | Sequence[PathLike], pytorch_format: bool = False) -> dict[str, Any]:
    """Load and combine every rank file of a distributed save (paths in any order, or a manifest path).

    Every file's ``trainer_options``, ``distributed`` and ``train_step_info`` are read and the set
    is validated (missing, duplicate or foreign ranks, mixed steps or runs) before any tensor is
    read; errors name the files and ranks. See :func:`aggregate_states` for the result.
    """
    with _open_set(paths) as plan:
        return build_tree(assemble(plan, pytorch_format=pytorch_format))


def _reporting(
    items: Iterable[tuple[Key, Any]], total: int, progress: Callable[[int, int], None]
) -> Iterator[tuple[Key, Any]]:
    """Pass ``items`` through, calling ``progress(done, total)`` after each value (not group) is consumed."""
    done = 0
    for pair in items:
        leaf = not isinstance(pair[1], Mapping)
        yield pair
        del pair  # the writer is done with it: do not keep it alive while the next one is produced
        if leaf:
            done += 1
            progress(done, total)


def aggregate_to_file(
    paths: PathLike | Sequence[PathLike],
    out_path: PathLike,
    *,
    pytorch_format: bool = False,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Like :func:`aggregate_checkpoints`, but stream the result into a checkpoint at ``out_path``.

    Tensors are read, combined and written one at a time (peak memory about two full tensors plus
    HDF5 buffers). The file is published atomically only if everything succeeded; it loads with
    ``checkpoint.load`` and its checksums verify. ``progress(done, total)``, if given, is called
    after each value is written (``total`` values in all).
    """
    with _open_set(paths) as plan:
        count = leaf_count(plan, pytorch_format=pytorch_format)
        values = assemble(plan, pytorch_format=pytorch_format, reuse_output=True)
        if progress is not None:
            values = _reporting(values, count, progress)
        return save_stream(values, out_path, max_leaves=count, overwrite=overwrite)
