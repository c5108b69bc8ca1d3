"""Where a checkpoint file lives: a local path, or an fsspec URL (``s3://``, ``memory://``, ``gs://``...).

:func:`resolve` turns what the user passed into a :class:`Location` (the protocol below, with its call
order and promises): a :class:`LocalLocation`, a :class:`RemoteLocation`, or what a backend registered for
the URL's scheme with :func:`register_scheme` makes (so a third backend does not mean editing ``resolve``).
Plain paths and ``file://`` URLs are local and need nothing beyond the standard library: ``fsspec`` is
imported only when a remote URL is used.

Atomic publish on object storage: a finished local file is uploaded to a temporary key next to the
target (``.<name>.tmp-<pid>-<hex>``), then moved to the final key (a server-side copy on S3: readers
see the old object or the new one, never part of one). Every storage failure becomes a
:class:`CheckpointStorageError` naming the URL (missing credentials, no filesystem for the scheme).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from ..errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CheckpointStorageError
from ..format.files import fsync_path, publish, temp_name
from ._stale import remove_stale_objects

__all__ = [
    "LocalFile",
    "LocalLocation",
    "Location",
    "RemoteLocation",
    "RemoteStore",
    "is_url",
    "register_scheme",
    "resolve",
    "temp_name",
]

PathLike = str | os.PathLike[str]
# Stores whose put can be conditional (If-None-Match: *) and appears atomically: ``overwrite=False`` is enforced
# by the store itself. Elsewhere it is an existence check before the upload (racy between concurrent writers).
_CONDITIONAL_PUT = frozenset({"s3", "s3a"})
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")  # two letters at least: C:\ is a Windows drive, not a URL


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` strings (``file://`` included), False for plain paths."""
    return isinstance(path, str) and _URL.match(path) is not None


@runtime_checkable
class Location(Protocol):
    """One checkpoint file (or folder) of a storage backend: what the readers and writers of ``io``,
    ``objects`` and ``manager`` ask of it, and all they may assume.

    Call order of a save: :func:`resolve` -> the target check (``is_dir``; ``parent_exists`` / ``make_dirs`` of
    ``folder()``; ``exists`` unless overwriting) -> the file is written (a :class:`LocalFile` in place through
    its temporary file; a :class:`RemoteStore` to a local spool file, then ``publish_file``) -> small files
    beside it (manifest, index) through ``sibling(name).write_bytes``. A load: ``exists`` / ``read_bytes`` for
    small files; the checkpoint itself through ``path`` (local) or ``fetch_to`` (remote). Cleanup:
    ``folder().list_names()``, ``sibling(name).remove()``.

    Promises: ``write_bytes`` is atomic for readers (the old content or the new, never part of it) and refuses
    an existing file unless ``overwrite`` (``CheckpointExistsError``); ``read_bytes`` of a missing file raises
    ``CheckpointNotFoundError``; ``remove`` returns False for a missing file; ``list_names`` of a missing
    folder is empty; any other storage failure is an ``OSError`` / ``CheckpointStorageError`` naming
    ``display``. ``remote`` says which extension the location also implements: :class:`LocalFile` (False)
    or :class:`RemoteStore` (True).
    """

    remote: bool
    display: str  # what messages call it: the path or the URL
    name: str  # the last part of the path or key

    def sibling(self, name: str) -> Location: ...

    def child(self, name: str) -> Location: ...

    def folder(self) -> Location: ...

    def exists(self) -> bool: ...

    def is_dir(self) -> bool: ...

    def parent_exists(self) -> bool: ...

    def list_names(self) -> list[str]: ...

    def make_dirs(self) -> None: ...

    def read_bytes(self) -> bytes: ...

    def write_bytes(self, data: bytes, *, overwrite: bool) -> None: ...

    def remove(self) -> bool: ...


class LocalFile(Location, Protocol):
    """A location this process opens directly (``remote`` is False): HDF5 reads and writes ``path`` itself."""

    path: Path

    def local_file(self) -> contextlib.AbstractContextManager[Path]: ...


class RemoteStore(Location, Protocol):
    """A location behind an object store (``remote`` is True): a checkpoint is written to a local spool file and
    published whole, and read from a downloaded copy."""

    def publish_file(self, local: Path, *, overwrite: bool) -> None:
        """Make the finished local file this location's content, atomically for readers (refusing an existing
        one unless ``overwrite``)."""
        ...

    def fetch_to(self, local: Path) -> None:
        """Download this location's content into the local file ``local``."""
        ...

    def refuse_existing(self, overwrite: bool) -> None:
        """``CheckpointExistsError`` if the location exists and ``overwrite`` is False."""
        ...


class LocalLocation:
    """A file on a local (or mounted shared) file system."""

    remote = False

    def __init__(self, path: PathLike) -> None:
        self.path = Path(os.fspath(path))
        self.display = str(self.path)
        self.name = self.path.name

    def __repr__(self) -> str:
        return f"LocalLocation({self.display!r})"

    def sibling(self, name: str) -> LocalLocation:
        return LocalLocation(self.path.with_name(name))

    def child(self, name: str) -> LocalLocation:
        return LocalLocation(self.path / name)

    def folder(self) -> LocalLocation:
        return LocalLocation(self.path.parent)

    def exists(self) -> bool:
        return self.path.exists()

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def parent_exists(self) -> bool:
        return self.path.parent.is_dir()

    def list_names(self) -> list[str]:
        """Names of the entries of this folder (empty if it does not exist)."""
        return sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []

    def make_dirs(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def read_bytes(self) -> bytes:
        if not self.path.is_file():  # a FIFO is no file either: reading it would block
            raise CheckpointNotFoundError(f"{self.display}: no such file")
        try:
            return self.path.read_bytes()
        except FileNotFoundError:  # removed since
            raise CheckpointNotFoundError(f"{self.display}: no such file") from None

    def write_bytes(self, data: bytes, *, overwrite: bool) -> None:
        """Write ``data`` to a temporary file, fsync it, publish it atomically (refusing to replace unless asked)."""
        tmp = self.path.with_name(temp_name(self.name))
        try:
            tmp.write_bytes(data)
            fsync_path(tmp, os.O_RDONLY)
            publish(tmp, self.path, overwrite)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def remove(self) -> bool:
        """Delete the file; False if it was not there."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def local_file(self) -> Iterator[Path]:
        yield self.path


class RemoteLocation:
    """An object (file) behind an fsspec URL; the filesystem comes from ``fsspec`` (+ ``s3fs`` for S3)."""

    remote = True

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, _fs: Any = None) -> None:
        self.url = url
        self.scheme = _URL.match(url).group(1).lower()
        self.storage_options = dict(storage_options or {})
        self.fs, self.key = (_fs, _strip(_fs, url)) if _fs is not None else _filesystem(url, self.storage_options)
        self.display = self.url
        self.name = self.key.rstrip("/").rsplit("/", 1)[-1]

    def __repr__(self) -> str:
        return f"RemoteLocation({self.display!r})"

    def _with_key(self, key: str) -> RemoteLocation:
        return RemoteLocation(self.fs.unstrip_protocol(key), self.storage_options, _fs=self.fs)

    def sibling(self, name: str) -> RemoteLocation:
        return self.folder().child(name)

    def child(self, name: str) -> RemoteLocation:
        return self._with_key(f"{self.key.rstrip('/')}/{name}")

    def folder(self) -> RemoteLocation:
        return self._with_key(self.key.rstrip("/").rsplit("/", 1)[0])

    def exists(self) -> bool:
        with storage_errors(self.display, "check"):
            return bool(self.fs.exists(self.key))

    def is_dir(self) -> bool:
        with storage_errors(self.display, "check"):
            return bool(self.fs.isdir(self.key))

    def parent_exists(self) -> bool:
        return True  # object stores have no folders to create first

    def list_names(self) -> list[str]:
        with storage_errors(self.display, "list"):
            try:
                entries = self.fs.ls(self.key, detail=False, refresh=True)
            except FileNotFoundError:
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def make_dirs(self) -> None:
        with storage_errors(self.display, "create"):
            self.fs.makedirs(self.key, exist_ok=True)

    def read_bytes(self) -> bytes:
        with storage_errors(self.display, "read"):
            return bytes(self.fs.cat_file(self.key))

    def write_bytes(self, data: bytes, *, overwrite: bool) -> None:
        self.refuse_existing(overwrite)
        if not overwrite and self.scheme in _CONDITIONAL_PUT:
            self._create(lambda: self.fs.pipe_file(self.key, data, mode="create"))
            return
        tmp = self.sibling(temp_name(self.name))
        with storage_errors(self.display, "write"), _removing_on_error(tmp):
            self.fs.pipe_file(tmp.key, data)
            _move(self.fs, tmp.key, self.key)

    def publish_file(self, local: Path, *, overwrite: bool) -> None:
        """Upload a finished local file to a temporary key, then move it to this key."""
        self.refuse_existing(overwrite)
        remove_stale_objects(self.fs, self.folder().key)
        if not overwrite and self.scheme in _CONDITIONAL_PUT:
            self._create(lambda: self.fs.put_file(os.fspath(local), self.key, mode="create"))
            return
        tmp = self.sibling(temp_name(self.name))
        with storage_errors(self.display, "upload"), _removing_on_error(tmp):
            self.fs.put_file(os.fspath(local), tmp.key)
            _move(self.fs, tmp.key, self.key)

    def _create(self, put: Any) -> None:
        """Write the object straight to its key, only if no object is there (S3 ``If-None-Match: *``):
        of two concurrent writers with ``overwrite=False`` exactly one succeeds. A put is atomic for
        readers (the object appears whole when the upload completes), so no temporary key is needed."""
        with storage_errors(self.display, "upload"):
            try:
                put()
            except FileExistsError:
                raise CheckpointExistsError(
                    f"{self.display} already exists (written by another writer meanwhile); pass overwrite=True "
                    "to replace it"
                ) from None

    def fetch_to(self, local: Path) -> None:
        with storage_errors(self.display, "download"):
            self.fs.get_file(self.key, os.fspath(local))

    def remove(self) -> bool:
        with storage_errors(self.display, "delete"):
            try:
                self.fs.rm_file(self.key)
            except FileNotFoundError:
                return False
        return True

    def refuse_existing(self, overwrite: bool) -> None:
        if not overwrite and self.exists():
            raise CheckpointExistsError(f"{self.display} already exists; pass overwrite=True to replace it")


SchemeFactory = Callable[[str, Mapping[str, Any] | None], Location]
_SCHEMES: dict[str, SchemeFactory] = {}


def register_scheme(scheme: str, factory: SchemeFactory) -> None:
    """Resolve URLs ``<scheme>://...`` with ``factory(url, storage_options)`` (a :class:`Location`) instead of
    fsspec: how a third storage backend joins without editing :func:`resolve`."""
    if not isinstance(scheme, str) or not _URL.match(f"{scheme}://"):
        raise ValueError(f"a URL scheme is a letter, then letters, digits, '+', '-' or '.' (2+ in all), got {scheme!r}")
    if not callable(factory):
        raise TypeError(f"factory must be a callable (url, storage_options) -> Location, got {factory!r}")
    _SCHEMES[scheme.lower()] = factory


def resolve(path: PathLike | Location, storage_options: Mapping[str, Any] | None = None) -> Location:
    """A location for ``path``: a local path (str / PathLike / ``file://`` URL), a URL of a registered scheme
    (:func:`register_scheme`) or any other fsspec URL; a :class:`Location` is returned as it is."""
    if isinstance(path, Location):
        return path
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise TypeError(f"a checkpoint path must be a non-empty str, os.PathLike or URL, got {path!r}")
    if not is_url(path):
        return LocalLocation(path)
    factory = _SCHEMES.get(_URL.match(path).group(1).lower())
    return factory(path, storage_options) if factory is not None else RemoteLocation(path, storage_options)


def _file_url_path(url: str) -> str:
    """The local path of a ``file://`` URL: ``file:///abs/path`` or ``file://localhost/abs/path`` (RFC 8089).

    Anything between ``file://`` and the next ``/`` is a host name: ``file://runs/ck.ortcp`` names host
    ``runs``, not the relative path ``runs/ck.ortcp``, and is refused rather than written to ``/ck.ortcp``.
    """
    parsed = urlparse(url)
    if parsed.netloc.lower() not in ("", "localhost"):
        raise ValueError(
            f"{url}: a file:// URL names the host '{parsed.netloc}', but only this machine's files can be "
            f"written (file:///absolute/path or file://localhost/absolute/path); for a relative path give it "
            f"without file://, e.g. '{parsed.netloc}{parsed.path}'"
        )
    if parsed.query or parsed.fragment:
        raise ValueError(f"{url}: a file:// URL with '?' or '#' is ambiguous; give the path without file://")
    return unquote(parsed.path)


def _filesystem(url: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    """(fsspec filesystem, key) for ``url``; CheckpointStorageError naming the scheme when it cannot be had."""
    scheme = _URL.match(url).group(1).lower()
    try:
        import fsspec
    except ImportError:
        raise CheckpointStorageError(
            f"{url}: URLs need the 'fsspec' package (pip install fsspec; s3fs for s3://); local paths need nothing"
        ) from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise CheckpointStorageError(f"{url}: no fsspec filesystem is known for the scheme '{scheme}://'") from None
    except ImportError as exc:
        raise CheckpointStorageError(
            f"{url}: the fsspec filesystem for '{scheme}://' is not installed ({exc})"
        ) from None
    with storage_errors(url, "open the filesystem of"):
        return fsspec.core.url_to_fs(url, **storage_options)


def _strip(fs: Any, url: str) -> str:
    return fs._strip_protocol(url)


def _move(fs: Any, source: str, target: str) -> None:
    """Copy exactly ``source`` to exactly ``target`` (server-side on S3), then delete ``source``.

    Not ``fs.mv``: it expands ``?``, ``*`` and ``[`` as glob patterns and, for such names, moves the
    object into a "folder" ``<target>/`` instead. A temporary object left by a failed delete is removed
    by a later save (see ``_stale``).
    """
    fs.cp_file(source, target)
    with contextlib.suppress(Exception):
        fs.rm_file(source)


@contextlib.contextmanager
def _removing_on_error(tmp: RemoteLocation) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            tmp.fs.rm_file(tmp.key)
        raise


@contextlib.contextmanager
def storage_errors(where: str, action: str) -> Iterator[None]:
    """Re-raise a filesystem's exception as our CheckpointError family, naming ``where``."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where}: no such file or object") from None
    except Exception as exc:
        kind = type(exc).__name__
        if "Credential" in kind or isinstance(exc, PermissionError):
            raise CheckpointStorageError(
                f"{where}: cannot {action} it: access denied or no credentials ({kind}: {exc}); configure the "
                "credentials of this storage (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, or "
                "storage_options)"
            ) from exc
        raise CheckpointStorageError(f"{where}: cannot {action} it ({kind}: {exc})") from exc


register_scheme("file", lambda url, _options: LocalLocation(_file_url_path(url)))
