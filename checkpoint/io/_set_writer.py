"""Writing a distributed save: every rank's file, then the manifest (the commit point), then the old set goes.

Two styles, told apart by the paths the ranks pass (gathered over the process group):

* **one shared path** (``save_checkpoint("ckpt.ortcp")`` on every rank): rank r writes
  ``ckpt.rank<r>-of-<W>.<save id>.ortcp``, a name no earlier save used, so the set being replaced
  stays whole. Each rank reports its file's name, size and CRC-32 (computed on its own file) over
  the process group; rank 0 writes the manifest from those reports, so no rank reads another
  rank's file (node-local disks work). The manifest is published atomically: it is the commit point.
  Only then each rank removes its files of the replaced set, and of earlier saves to the same path
  that died before their manifest was published.
* **one path per rank** (legacy ``save_checkpoint(f"ckpt{rank}.ortcp")``): each rank writes exactly
  the path it was given, nothing else. The files describe themselves (run id, step, rank, world
  size, partitions), so aggregation rejects incomplete, duplicated or mixed sets.

Every rank takes part in every collective whatever fails, and every rank raises (the same failure),
so no rank is left waiting. :func:`plan_set_save` runs on the training thread (it agrees on the target
and the run id); :func:`write_set` may run on a background thread with a collective of its own.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CheckpointError, CheckpointExistsError
from ..format import schema as S
from ..sets import Manifest, ManifestEntry, manifest_bytes, rank_file_name, split_suffix
from ._location import Location
from ._transfer import FileRecord, make_parent_folder, read_manifest_at, write_file

logger = logging.getLogger(__name__)

__all__ = ["Collective", "SetPlan", "plan_set_save", "remove_set", "write_set"]

_SAVE_ID_DIGITS = 8


class Collective(Protocol):
    """What the set writer needs from a process group: this rank, the world size, an all-gather of objects."""

    rank: int
    world_size: int

    def all_gather_object(self, value: Any) -> list[Any]: ...


@dataclass(frozen=True)
class SetPlan:
    """What every rank agreed on before writing (identical on all ranks except ``target`` and ``replaced``)."""

    shared: bool  # one path for all ranks (rank files + manifest), else one path per rank
    rank: int
    world_size: int
    run_id: str
    requested: str  # the path this rank was given, for messages
    target: Location  # this rank's file
    manifest: Location | None  # shared style only
    replaced: tuple[str, ...]  # names (next to target) of old files this rank removes once the new set is published
    overwrite: bool


def _rank_file_pattern(requested_name: str, rank: int, world_size: int | None) -> re.Pattern[str]:
    """Names of ``rank``'s files of saves to ``requested_name``: any save id (or none); any world size if None."""
    stem, suffix = split_suffix(requested_name)
    world = r"\d+" if world_size is None else str(world_size)
    infix = re.escape(S.RANK_FILE_INFIX.format(rank=rank, world_size="@W")).replace("@W", world)
    return re.compile(f"{re.escape(stem)}{infix}(\\.{S.SAVE_ID_RE.pattern})?{re.escape(suffix)}")


def _stale_names(target: Location, requested_name: str, rank: int, world_size: int) -> list[str]:
    """This rank's files of earlier saves to the same path (any save id) found in the folder."""
    pattern = _rank_file_pattern(requested_name, rank, world_size)
    try:
        names = target.folder().list_names()
    except (OSError, CheckpointError):
        return []
    return [n for n in names if n != target.name and pattern.fullmatch(n)]


def _old_entries(manifest: Location) -> list[tuple[int, str]] | None:
    """(rank, name) of the set a manifest lists; None if there is none or it cannot be read."""
    try:
        if not manifest.exists():
            return None
        return [(e.rank, e.name) for e in read_manifest_at(manifest).files]
    except (OSError, CheckpointError):
        return None


def _describe(target: Location, overwrite: bool, shared_manifest: Location | None) -> dict[str, Any]:
    """What this rank tells the others before a save: its path and whether anything would be refused.

    A missing folder is created first (every rank, its own path; the same folder on a shared path is fine);
    ``folder`` carries the error if that failed, so that every rank refuses the save alike.
    """
    info: dict[str, Any] = {"path": target.display, "exists": False, "folder": None}
    try:
        make_parent_folder(target)
    except (OSError, CheckpointError) as exc:
        info["folder"] = f"{type(exc).__name__}: {exc}"
    if not overwrite:
        info["exists"] = target.exists()
    if shared_manifest is not None:
        info["manifest_exists"] = shared_manifest.exists()
        info["old"] = _old_entries(shared_manifest)
    return info


def plan_set_save(comm: Collective, target: Location, overwrite: bool) -> SetPlan:
    """Agree on the style, the run id and what is refused (one all-gather on every rank)."""
    manifest = target.sibling(target.name + S.MANIFEST_SUFFIX)
    info = _describe(target, overwrite, manifest if comm.rank == 0 else None)
    if comm.rank == 0:
        info["run_id"] = uuid.uuid4().hex
    gathered = comm.all_gather_object(info)
    paths = [g["path"] for g in gathered]
    listed = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
    distinct = len(set(paths))
    if distinct not in (1, comm.world_size):
        raise ValueError(
            f"save_checkpoint on {comm.world_size} ranks got the same path on some ranks and different paths on "
            f"others ({listed}); pass one path on every rank (rank files + a manifest) or a different path on "
            "each rank (one file per rank, the legacy style)"
        )
    shared = distinct == 1 or comm.world_size == 1
    _refuse(gathered, shared, overwrite, manifest)
    run_id = gathered[0]["run_id"]
    if not shared:
        return SetPlan(False, comm.rank, comm.world_size, run_id, target.display, target, None, (), overwrite)
    old = gathered[0].get("old") or []
    new_name = rank_file_name(target.name, comm.rank, comm.world_size, run_id[:_SAVE_ID_DIGITS])
    mine = target.sibling(new_name)
    replaced = {name for rank, name in old if rank % comm.world_size == comm.rank}
    replaced.update(_stale_names(mine, target.name, comm.rank, comm.world_size))
    replaced.discard(new_name)
    return SetPlan(
        True, comm.rank, comm.world_size, run_id, target.display, mine, manifest, tuple(sorted(replaced)), overwrite
    )


def _refuse(gathered: list[dict[str, Any]], shared: bool, overwrite: bool, manifest: Location) -> None:
    """The same refusal on every rank: a folder that could not be made, or an existing save without ``overwrite``."""
    missing = [f"rank {r}: {g['folder']}" for r, g in enumerate(gathered) if g["folder"]]
    if missing:
        raise FileNotFoundError(f"cannot save: could not create the folder of {'; '.join(missing)}")
    if overwrite:
        return
    if shared and gathered[0]["manifest_exists"]:
        raise CheckpointExistsError(f"{manifest.display} already exists; pass overwrite=True to replace the set")
    existing = [f"rank {r}: {g['path']}" for r, g in enumerate(gathered) if g["exists"]]
    if existing and not shared:
        raise CheckpointExistsError(f"{', '.join(existing)} already exist(s); pass overwrite=True to replace them")


def write_set(plan: SetPlan, comm: Collective, tree: Mapping[str, Any], step: int) -> list[str]:
    """Write this rank's file; in the shared style rank 0 then publishes the manifest and old files go.

    Returns what this rank published (its file; the manifest too on rank 0). Raises on every rank if
    any rank failed; then the previous set is untouched (shared style) and no manifest names the new one.
    """
    record, error = None, None
    try:
        record = write_file(tree, plan.target, overwrite=plan.overwrite and not plan.shared)
    except Exception as exc:  # every rank must still reach the collectives below
        error = exc
    reports = comm.all_gather_object(None if error else _as_dict(record))
    failed = [r for r, report in enumerate(reports) if report is None]
    if failed:
        if plan.shared and record is not None:
            _remove(plan.target)
        if error is not None:
            raise error
        raise CheckpointError(
            f"rank(s) {failed} failed to write their file of {plan.requested} (see their error); "
            + ("no manifest was written: the previous set is intact" if plan.shared else "the set is incomplete")
        )
    if not plan.shared:
        return [plan.target.display]
    manifest_error = None
    if plan.rank == 0:
        try:
            _publish_manifest(plan, reports, step)
        except Exception as exc:
            manifest_error = exc
    outcome = comm.all_gather_object(
        None if manifest_error is None else f"{type(manifest_error).__name__}: {manifest_error}"
    )[0]
    if outcome is not None:
        _remove(plan.target)
        if manifest_error is not None:
            raise manifest_error
        raise CheckpointError(f"rank 0 failed to write the manifest of {plan.requested}: {outcome}")
    for name in plan.replaced:  # only now: the new set is published
        _remove(plan.target.sibling(name))
    return [plan.target.display] + ([plan.manifest.display] if plan.rank == 0 else [])


def _as_dict(record: FileRecord) -> dict[str, Any]:
    return {"name": record.name, "size": record.size, "crc32": record.crc32}


def _publish_manifest(plan: SetPlan, reports: list[dict[str, Any]], step: int) -> None:
    entries = tuple(ManifestEntry(rank=r, **report) for r, report in enumerate(reports))
    manifest = Manifest(
        path=plan.manifest.display, run_id=plan.run_id, world_size=plan.world_size, step=step, files=entries
    )
    plan.manifest.write_bytes(manifest_bytes(manifest), overwrite=True)


def _remove(loc: Location) -> None:
    try:
        loc.remove()
    except (OSError, CheckpointError) as exc:
        logger.warning("could not remove %s: %s", loc.display, exc)


def remove_set(path: Location, comm_rank: int) -> list[str]:
    """Delete a distributed save to ``path``: rank 0 the manifest first (the set stops being a checkpoint),
    then the rank files it lists that this process can see; every rank its own rank files of that path."""
    removed = []
    manifest = path.sibling(path.name + S.MANIFEST_SUFFIX)
    old = _old_entries(manifest) if comm_rank == 0 else None
    if comm_rank == 0 and manifest.remove():
        removed.append(manifest.display)
    names = {name for _, name in old or []}
    own = _rank_file_pattern(path.name, comm_rank, None)
    try:
        names.update(n for n in path.folder().list_names() if own.fullmatch(n))
    except (OSError, CheckpointError):
        pass
    for name in sorted(names):
        loc = path.sibling(name)
        if loc.remove():
            removed.append(loc.display)
    return removed
