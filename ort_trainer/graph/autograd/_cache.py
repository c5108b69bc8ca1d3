"""`GraphCache`: exported training graphs on disk, so that a resume, a restarted job or the next rank
builds in the time of a trace instead of an export; `get_or_build`, the one way both doors use it (the trainer's
autograd engine and ORTModule).

Keyed by sha256 of everything that decides the graph: the traced aten code, input names, shapes and
dtypes, constant values (`TracedGraph.fingerprint`), the build options, and the versions of torch,
onnxscript, onnx-ir, onnx, onnxruntime and ort_trainer; a changed model or library never reuses a stale graph.
Files are written through the checkpoint package's file rules (``checkpoint.format.files``: a temporary name with
the writer's host and pid, fsync, an atomic rename, the folder fsynced; temporary files of killed writers removed
at the next write), so a reader never sees half a file, one process builds
a given key while the others wait on an ``flock`` (released by the kernel if that process dies), a file
that does not parse or does not verify is dropped and rebuilt, and the folder is kept under a size bound by
deleting the least recently used files. Each file ends with sha256 of its key and its content (`_seal`), checked
on every load: a damaged file, or another graph's file copied under this key, is a miss (a warning), never a
graph that trains wrong numbers. This catches accidents, not someone who can write to the folder (they can write
a matching digest too): the folder is a trust boundary (docs/engines.md, "Graph cache").
Environment: ``ORT_TRAINER_GRAPH_CACHE=0`` turns it off,
``ORT_TRAINER_GRAPH_CACHE_DIR`` moves it (default ``$XDG_CACHE_HOME/ort_trainer/graphs``, else
``~/.cache/ort_trainer/graphs``), ``ORT_TRAINER_GRAPH_CACHE_MB`` bounds it (default 2048).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

if TYPE_CHECKING:
    from ._trace import TracedGraph

__all__ = ["GraphCache", "get_or_build", "graph_cache_from_env"]

_log = logging.getLogger("ort_trainer")
_SUFFIX = ".onnx"
# the ``metadata_props`` entry each file ends with (`_seal`): sha256 of the entry's key and of the bytes before it
_DIGEST = "ort_trainer.graph_cache.sha256"
# files older releases kept beside the graphs (the pre-key's ``<pre-key>.alias``, removed: docs/engines.md "Graph
# cache"): never read, not counted against the bound, deleted when the folder is next trimmed
_LEFTOVERS = (".alias",)
# every package whose release can change an exported graph: the exporter is torch's, onnxscript's translations and
# onnx-ir's passes (its optimizer runs on our graphs: `_to_onnx`)
_VERSIONED = (
    "torch", "onnxscript", "onnx-ir", "onnx", "onnxruntime", "onnxruntime-training", "onnxruntime-gpu", "ort_trainer",
)  # fmt: skip


class GraphCache:
    """A folder of ``<key>.onnx`` files, bounded to ``max_bytes`` (least recently used files go first)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 2048 << 20):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)

    @staticmethod
    def key(fingerprint: str, options: Mapping[str, object]) -> str:
        """The cache key of a traced graph under build ``options``, with the library versions mixed in."""
        digest = hashlib.sha256(fingerprint.encode())
        digest.update(repr(sorted((str(k), repr(v)) for k, v in options.items())).encode())
        digest.update(repr(_versions()).encode())
        digest.update(_own_source_digest().encode())  # an editable install changes code without a new version
        return digest.hexdigest()

    def get(self, key: str) -> onnx.ModelProto | None:
        """The cached graph, or None: missing; not readable by this process (another user's file, a directory:
        left in place, a miss); or not a graph verified by its digest (then deleted so that it is rebuilt)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:  # a shared folder must not stop training: build in memory, replace it if we may
            _log.warning("graph cache: cannot read %s (%s): building the graph without it", path, error)
            return None
        body, seal = data[:-_SEAL_SIZE], data[-_SEAL_SIZE:]
        try:
            if len(data) <= _SEAL_SIZE or seal != _seal(key, body):
                raise ValueError("its sha256 does not match its content and key: damaged, or another graph's file")
            model = onnx.load_from_string(body)
            if not model.graph.output:
                raise ValueError("no outputs")
        except Exception as error:  # noqa: BLE001 - any unreadable file is a miss, logged
            _log.warning("graph cache: dropping unreadable %s (%s)", path, error)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently *used*: a hit counts as a use
        return model

    def put(self, key: str, model: onnx.ModelProto) -> None:
        """Write atomically (temporary file + rename), sealed with its key's digest, then trim the folder to its
        bound."""
        body = model.SerializeToString()
        self._write(self._path(key), body + _seal(key, body))
        self._trim()

    @contextlib.contextmanager
    def building(self, key: str) -> Iterator[None]:
        """Hold the key's lock while building it: other processes building the same graph wait, then hit.

        The lock is opened read-only (``flock`` needs no more, so another user's lock serves too) and never through
        a symbolic link: one planted at ``<key>.lock`` would have the build create a file wherever it points. That
        is an OSError (ELOOP), which callers treat as any unusable cache: a warning, and a build without it."""
        path = self._path(key).with_suffix(".lock")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise OSError(errno.ELOOP, "the lock is a symbolic link, not followed", str(path)) from None
        with os.fdopen(fd, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def get_or_build(
        self,
        key: str,
        build: Callable[[], onnx.ModelProto],
        usable: Callable[[onnx.ModelProto], bool] = lambda model: True,
    ) -> tuple[onnx.ModelProto, bool]:
        """The graph under ``key`` and whether it came from the cache: a verified, ``usable`` entry, else
        ``build()``, stored. Other processes building the same key wait for this one (`building`). A folder that
        cannot be used, or an entry that cannot be stored, is a warning: the graph is built without the cache."""
        try:
            lock = self.building(key)
            lock.__enter__()
        except OSError as error:  # a read-only or full cache folder must not stop training
            _log.warning("graph cache %s unusable (%s): exporting without it", self.directory, error)
            return build(), False
        try:
            model = self.get(key)
            if model is not None and usable(model):
                return model, True
            model = build()
            try:
                self.put(key, model)
            except OSError as error:
                _log.warning("graph cache %s: could not store the graph (%s)", self.directory, error)
            return model, False
        finally:
            lock.__exit__(None, None, None)

    def _write(self, path: Path, data: bytes) -> None:
        """``data`` to ``path`` by the checkpoint package's file rules: a temporary name that carries this host and
        pid (`files.temp_path`), fsync, an atomic rename and the folder fsynced (`files.publish`); temporary files
        of writers that were killed are removed first (`cleanup_temp_files`). Created with mode 0o666 less the
        umask, as any file the user creates (`tempfile.mkstemp`'s 0o600 would lock the rest of a group out of a
        folder it shares with umask 002)."""
        from ort_trainer.checkpoint.format import cleanup_temp_files  # the checkpoint package: only when writing
        from ort_trainer.checkpoint.format.files import publish, temp_path

        self.directory.mkdir(parents=True, exist_ok=True)
        cleanup_temp_files(self.directory)
        temp = temp_path(path)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # O_EXCL: never a link
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            publish(temp, path, overwrite=True)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def _path(self, key: str) -> Path:
        if not _is_key(key):
            raise ValueError(f"graph cache key must be 64 hex digits, got {key!r}")
        return self.directory / f"{key}{_SUFFIX}"

    def _trim(self) -> None:
        for suffix in _LEFTOVERS:
            for path in self.directory.glob(f"*{suffix}"):
                with contextlib.suppress(OSError):
                    path.unlink()
        entries = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = path.stat()
                entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                path.with_suffix(".lock").unlink(missing_ok=True)
                total -= size
                _log.info("graph cache: evicted %s (%d bytes) to stay under %d bytes", path.name, size, self.max_bytes)


def _seal(key: str, body: bytes) -> bytes:
    """The bytes that end the entry ``key`` whose graph is ``body``: one ``metadata_props`` entry holding sha256 of
    the key and the body. Appended protobuf fields merge into the message, so the file stays an ONNX model; the key
    is in the digest so that a file copied from another key does not verify. Always `_SEAL_SIZE` bytes long."""
    digest = hashlib.sha256(key.encode() + b"\0" + body).hexdigest()
    entry = onnx.StringStringEntryProto(key=_DIGEST, value=digest)
    return onnx.ModelProto(metadata_props=[entry]).SerializeToString()


_SEAL_SIZE = len(_seal("0" * 64, b""))


def _is_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def get_or_build(
    cache: GraphCache | None,
    traced: TracedGraph,
    options: Mapping[str, object],
    build: Callable[[], onnx.ModelProto],
    usable: Callable[[onnx.ModelProto], bool] = lambda model: True,
) -> tuple[onnx.ModelProto, bool]:
    """``traced``'s ONNX graph under build ``options`` and whether it came from ``cache`` (None: no cache, always
    built): the trainer's autograd engine and ORTModule both ask for their graphs here (`GraphCache.get_or_build`)."""
    if cache is None:
        return build(), False
    return cache.get_or_build(GraphCache.key(traced.fingerprint(), options), build, usable)


def graph_cache_from_env(enabled: bool = True) -> GraphCache | None:
    """The cache the environment asks for (None when ``enabled`` is False or ``ORT_TRAINER_GRAPH_CACHE=0``)."""
    if not enabled or os.environ.get("ORT_TRAINER_GRAPH_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    directory = os.environ.get("ORT_TRAINER_GRAPH_CACHE_DIR")
    if not directory:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "ort_trainer", "graphs")
    text = os.environ.get("ORT_TRAINER_GRAPH_CACHE_MB", "2048")
    try:
        megabytes = int(text)
    except ValueError:
        megabytes = 0
    if megabytes <= 0:  # a zero bound would evict every graph as it is stored: say how to turn the cache off instead
        raise ValueError(
            f"ORT_TRAINER_GRAPH_CACHE_MB must be an integer number of MiB > 0, got {text!r} "
            "(to turn the graph cache off, set ORT_TRAINER_GRAPH_CACHE=0)"
        )
    return GraphCache(directory, megabytes << 20)


@functools.cache
def _own_source_digest() -> str:
    """sha256 of this package's source: how a graph is traced and exported is part of the key."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _versions() -> tuple[tuple[str, str], ...]:
    found = []
    for name in _VERSIONED:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(found)
