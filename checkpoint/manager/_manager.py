"""`CheckpointManager`: numbered checkpoints in one run directory, keep rules, and resume from the latest.

    manager = CheckpointManager("runs/lm", keep_last=3, async_save=True)
    restored = manager.restore(trainer)                  # None on a fresh start
    for step in range(restored.step if restored else 0, steps):
        ...
        manager.save(trainer, step + 1, metrics={"loss": loss})

Design (after orbax's CheckpointManager and torch DCP): each save is an ordinary
``trainer.save_checkpoint`` to ``<directory>/ckpt-<step>.ortcp`` (one file, or one set of rank files +
a manifest on W > 1 ranks), so its own commit point (the file / the manifest, published atomically)
says it is complete. Rank 0 records each save in the index before it starts, and prunes only after
the new checkpoint is durable (in the background for asynchronous saves). Pruning deletes only
checkpoints the index lists, i.e. that this manager wrote: foreign files in the directory are never
touched. Other processes may read the directory while training goes on (:meth:`latest`,
:meth:`checkpoints`): the index and the checkpoints are all replaced atomically.

Distributed runs: every rank calls :meth:`save` and :meth:`restore` with the same arguments; the
directory must be one all ranks see (a shared file system or object storage), because a restore
reads every rank's file. Rank 0 keeps the index and prunes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..io import LocalLocation, Location, SaveHandle, SaveScheduler, read_manifest_at, remove_set, resolve
from ..objects import ObjectsCheckpointable
from ..sets import check_manifest
from ._index import INDEX_NAME, MAX_STEP, IndexEntry, checkpoint_name, read_index, scan, write_index
from ._policy import RetentionPolicy, check_metrics

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "CheckpointManager", "Checkpointable", "RestoredCheckpoint"]

_RESCANS = 32  # a restore whose candidates keep being pruned under it scans the directory this often


class Checkpointable(Protocol):
    """What the manager needs from a trainer (``ORTTrainer`` has it): its public checkpoint calls, its step
    counters and options, and ``all_gather_objects`` so that every rank restores the same checkpoint."""

    options: Any  # ``options.distributed.world_rank`` / ``world_size``
    train_step_info: Any  # ``train_step_info.step``

    def save_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> SaveHandle: ...

    def load_checkpoint(self, *paths: Any, **kwargs: Any) -> dict: ...

    def wait_for_checkpoint(self) -> None: ...

    def all_gather_objects(self, value: Any) -> list: ...


class CheckpointInfo(NamedTuple):
    """A complete checkpoint in the run directory: its step, what to load (file or manifest), its metrics."""

    step: int
    path: str
    metrics: dict[str, float]


class RestoredCheckpoint(NamedTuple):
    """What :meth:`CheckpointManager.restore` loaded.

    ``step``: the step it was saved as (continue after it); ``path``: the file (or manifest) loaded;
    ``user_dict``: the ``user_dict`` given to that :meth:`CheckpointManager.save`, decoded (``{}`` if none);
    ``metrics``: the ``metrics`` given to it (``{}`` if none).
    """

    step: int
    path: str
    user_dict: dict[str, Any]
    metrics: dict[str, float]


class CheckpointManager:
    """Numbered checkpoints of one run in ``directory`` (a local folder or an fsspec URL).

    ``keep_last=k`` keeps the k newest, ``keep_every_n_steps=n`` every checkpoint whose step is a
    multiple of n, ``keep_best=(metric, "min" | "max", k)`` the k best by a metric given to
    :meth:`save`; a checkpoint any rule keeps is kept, and the newest always is. With no rule,
    nothing is deleted. ``async_save=True`` writes in the background (see ``ORTTrainer.save_checkpoint``).
    """

    def __init__(
        self,
        directory: str | Any,
        *,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        keep_best: tuple[str, str, int] | None = None,
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory: Location = resolve(directory, storage_options)
        if isinstance(self.directory, LocalLocation) and self.directory.path.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory.display} exists and is not a directory")
        self.policy = RetentionPolicy.create(keep_last, keep_every_n_steps, keep_best)
        self.async_save = bool(async_save)
        self.storage_options = dict(storage_options or {})
        self._index = self.directory.child(INDEX_NAME)
        self._lock = threading.Lock()
        self._entries: dict[int, IndexEntry] | None = None  # rank 0's record, read on first use
        self._in_flight: set[int] = set()  # steps whose save this process started and has not seen finish
        self._handle: SaveHandle | None = None
        self._error: SaveHandle | None = None  # a pruning failure, raised by the next call
        self._objects_io: SaveScheduler | None = None  # the background writer of saves of a dict of objects

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory.display!r}, {self.policy})"

    # ------------------------------------------------------------------ reading (any process)
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every complete checkpoint in the directory, oldest first (safe while another process trains)."""
        index = read_index(self._index)
        found = []
        for step, name in sorted(scan(self.directory.list_names()).items()):
            location = self.directory.child(name)
            if _complete(location):
                metrics = index[step].metrics if step in index else {}
                found.append(CheckpointInfo(step, location.display, dict(metrics)))
        return found

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or None."""
        self._raise_pending()
        found = self.checkpoints()
        return found[-1] if found else None

    # ------------------------------------------------------------------ saving
    def _as_checkpointable(self, trainer: Checkpointable | Mapping[str, Any]) -> Checkpointable:
        """A trainer as it is; a custom loop's dict of objects behind :class:`ObjectsCheckpointable`."""
        if not isinstance(trainer, Mapping):
            return trainer
        if self._objects_io is None:
            self._objects_io = SaveScheduler()
        return ObjectsCheckpointable(trainer, self._objects_io)

    def save(
        self,
        trainer: Checkpointable | Mapping[str, Any],
        step: int | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        user_dict: Mapping | None = None,
    ) -> SaveHandle:
        """Save ``trainer`` as checkpoint ``step`` (default: its ``train_step_info.step``), then prune.

        ``trainer`` may also be a custom loop's dict of objects with ``state_dict()`` / ``load_state_dict()``
        (``{"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "rng": RNGState()}``); then
        ``step`` is required. See docs/custom_loop_checkpoints.md.

        Returns the save's :class:`~ort_trainer.checkpoint.io.SaveHandle`, already done unless ``async_save``:
        an asynchronous save is durable only once published (``handle.wait()`` blocks until then and raises
        its error; ``done()`` / ``failed()`` ask without blocking; :meth:`wait` waits for the last one). Until
        then a crash leaves the previous checkpoint the newest. Pruning runs once the new checkpoint is
        durable; its failure (and a background save's) is raised by the next call.
        """
        self._raise_pending()
        if isinstance(trainer, Mapping) and step is None:
            raise ValueError("step is required when saving a dict of objects: manager.save(state, step)")
        trainer = self._as_checkpointable(trainer)
        step = trainer.train_step_info.step if step is None else step
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if step > MAX_STEP:
            raise ValueError(f"step must be at most {MAX_STEP} (18 digits: the names of the checkpoints), got {step}")
        metrics = check_metrics(metrics)
        trainer.wait_for_checkpoint()  # the previous save (and its pruning) first; raises its error
        self._raise_pending()
        self._refuse_lower_step(step)
        if isinstance(trainer, ObjectsCheckpointable):
            trainer.step = step
        rank0 = _rank(trainer) == 0
        self.directory.make_dirs()  # on every rank: each checks its folder before a distributed save
        if rank0:
            with self._lock:
                entries = self._load_entries()
                entries[step] = IndexEntry(step, checkpoint_name(step), metrics)
                write_index(self._index, entries)  # before the save: a killed save is still known as ours
                self._in_flight.add(step)
        try:
            handle = trainer.save_checkpoint(
                self.directory.child(checkpoint_name(step)),
                user_dict=user_dict,
                overwrite=True,
                async_save=self.async_save,
                storage_options=self.storage_options or None,
            )
        except BaseException:
            self._in_flight.discard(step)  # failed at the call: pruned as unfinished by a later save
            if rank0:
                self._forget_refused(step)
            raise
        if rank0:
            handle.add_done_callback(lambda done: self._after_save(done, step))
        self._handle = handle
        return handle

    def wait(self) -> None:
        """Block until the last save (and its pruning) is finished; raise its error (once: an error
        already raised by an earlier call is not raised again)."""
        if self._handle is not None:
            self._handle.wait_unreported()
        self._raise_pending()

    def _forget_refused(self, step: int) -> None:
        """A save refused at the call (e.g. inside an accumulation window) left nothing of ``step``: take its
        index entry out again, so that :meth:`restore` does not report it as a save that did not complete."""
        if step in scan(self.directory.list_names()):
            return  # something of it was written: pruned as unfinished by a later save
        try:
            with self._lock:
                entries = self._load_entries()
                if entries.pop(step, None) is not None:
                    write_index(self._index, entries)
        except (CheckpointError, OSError) as exc:  # the refusal is what the caller must see
            logger.warning("could not take step %d out of the index of %s: %s", step, self.directory.display, exc)

    def _refuse_lower_step(self, step: int) -> None:
        """A save below the newest checkpoint would be pruned as old (or hidden by it from :meth:`restore`).

        Only the manager's own checkpoints count (listed by the index and present: a foreign file named like
        one, or a save that never completed, does not). Checked on every rank (all see the directory and
        its index), so that all refuse together.
        """
        newer = [s for s in scan(self.directory.list_names()) if s > step]
        newer = [s for s in newer if s in read_index(self._index)] if newer else []
        if newer:
            raise ValueError(
                f"cannot save step {step} in {self.directory.display}: it already holds checkpoint step "
                f"{max(newer)}, and restore() loads the newest step (the keep rules would also delete step "
                f"{step} as older). After a rollback or a restarted step counter, save into a new directory or "
                "delete the newer checkpoints first"
            )

    # ------------------------------------------------------------------ restoring
    def restore(
        self, trainer: Checkpointable | Mapping[str, Any], step: int | None = None
    ) -> RestoredCheckpoint | None:
        """Load the newest complete checkpoint (or checkpoint ``step``) into ``trainer``.

        Returns a :class:`RestoredCheckpoint`: its ``step``, ``path``, and the ``user_dict`` and ``metrics``
        that were saved with it. Damaged checkpoints are skipped with a warning naming them, and so are saves
        that never completed. A checkpoint pruned while it is being restored (a watcher of a running job) is not
        damage: the directory is scanned again and the newest checkpoint now there is loaded. Returns None
        when the directory holds no checkpoint (a fresh start); raises CheckpointCorruptError when
        checkpoints exist but none of them loads. On W > 1 ranks all ranks load the checkpoint rank 0
        chose, and skip together. ``trainer`` may be a dict of objects as for :meth:`save`: every object is
        validated before any is loaded, and a failed restore leaves them all as they were.
        """
        self._raise_pending()
        trainer = self._as_checkpointable(trainer)
        gather = trainer.all_gather_objects
        skipped: list[str] = []
        damaged: set[int] = set()
        for scan_number in range(_RESCANS + 1):
            candidates = [c for c in gather(self._candidates(step, warn=scan_number == 0))[0] if c.step not in damaged]
            for info in candidates:
                outcome = _try_load(trainer, info, self.storage_options)
                if not isinstance(outcome, _Failure):
                    return RestoredCheckpoint(info.step, info.path, outcome, info.metrics)
                if outcome.vanished:  # pruned meanwhile, on every rank that failed: look again
                    if step is not None:
                        raise CheckpointNotFoundError(
                            f"checkpoint step {step} of {self.directory.display} was removed while it was restored"
                        )
                    logger.debug("checkpoint %s (step %d) was removed while it was restored", info.path, info.step)
                    break
                logger.warning("skipping checkpoint %s (step %d): %s", info.path, info.step, outcome.error)
                skipped.append(f"{info.path}: {outcome.error}")
                damaged.add(info.step)
            else:
                break  # every candidate was tried
        else:
            raise CheckpointNotFoundError(
                f"the checkpoints of {self.directory.display} were removed {_RESCANS + 1} times in a row while they "
                "were being restored (pruned faster than they can be loaded); try again"
            )
        if skipped:
            raise CheckpointCorruptError(
                f"no checkpoint in {self.directory.display} could be restored:\n  - " + "\n  - ".join(skipped)
            )
        return None

    def _candidates(self, step: int | None, *, warn: bool = True) -> list[CheckpointInfo]:
        """Complete checkpoints, newest first (only ``step`` if given); warns about saves that never completed."""
        found = self.checkpoints()
        complete = {info.step for info in found}
        newest = max(complete, default=-1)
        unfinished = [s for s in read_index(self._index) if s not in complete and s > newest] if warn else []
        for s in unfinished:
            logger.warning(
                "skipping checkpoint %s (step %d): the save did not complete "
                "(killed or failed before it was published)",
                self.directory.child(checkpoint_name(s)).display,
                s,
            )
        if step is not None:
            found = [info for info in found if info.step == step]
            if not found:
                raise CheckpointCorruptError(f"{self.directory.display} has no complete checkpoint of step {step}")
        return found[::-1]

    # ------------------------------------------------------------------ pruning (rank 0)
    def _load_entries(self) -> dict[int, IndexEntry]:
        if self._entries is None:
            self._entries = read_index(self._index)
        return self._entries

    def _after_save(self, handle: SaveHandle, step: int) -> None:
        """Once the save of ``step`` is durable: prune by the keep rules, forget failed saves, rewrite the index."""
        try:
            with self._lock:
                self._in_flight.discard(step)
                if not handle.failed():
                    self._prune(step)
        except Exception as exc:  # kept for the next call; printed at exit if no call comes
            self._error = SaveHandle(
                str(step), f"the pruning of {self.directory.display} after the save of step {step}"
            )
            self._error._finish(None, exc)

    def _prune(self, step: int) -> None:
        entries = self._load_entries()
        present = scan(self.directory.list_names())
        complete = {s for s in entries if s in present and (s == step or _complete(self.directory.child(present[s])))}
        kept = self.policy.kept((s, entries[s].metrics) for s in complete) | {step}  # never the save just made
        unfinished = [s for s in entries if s not in complete and s != step and s not in self._in_flight]
        for s in sorted(complete - kept) + unfinished:
            remove_checkpoint(self.directory, s)
            del entries[s]
        write_index(self._index, entries)

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            error.wait_unreported()


def remove_checkpoint(directory: Location, step: int) -> None:
    """Delete checkpoint ``step`` of a manager's directory: its manifest first, then its files."""
    location = directory.child(checkpoint_name(step))
    remove_set(location, 0)
    location.remove()


def _complete(location: Location) -> bool:
    """Is the checkpoint whose commit point is ``location`` there (a set: every file, with its size)?"""
    if not location.name.endswith(".manifest.json"):
        return location.exists()
    try:
        if not location.remote:
            check_manifest(location.path, checksums=False)
            return True
        present = set(location.folder().list_names())
        return all(entry.name in present for entry in read_manifest_at(location).files)
    except (CheckpointError, OSError):
        return False


def _rank(trainer: Checkpointable) -> int:
    """The trainer's rank (0 for a single process)."""
    return int(trainer.options.distributed.world_rank) if trainer.options.distributed.world_size > 1 else 0


class _Failure(NamedTuple):
    """Why a rank could not load a candidate (the first rank's message), and whether it had vanished
    on every rank that failed (pruned while it was read: no damage)."""

    error: str
    vanished: bool


def _try_load(trainer: Checkpointable, info: CheckpointInfo, storage_options: Mapping[str, Any]) -> Any:
    """Load ``info`` on every rank: the user_dict, or a :class:`_Failure` agreed by all ranks."""
    error, vanished = None, False
    try:
        user_dict = trainer.load_checkpoint(info.path, storage_options=storage_options or None)
    except (CheckpointError, OSError) as exc:  # damage or absence; a wrong model raises on
        error, vanished = f"{type(exc).__name__}: {exc}", isinstance(exc, FileNotFoundError)
    failures = [(e, v) for e, v in trainer.all_gather_objects((error, vanished)) if e is not None]
    if not failures:
        return user_dict
    return _Failure(failures[0][0], all(v for _, v in failures))
