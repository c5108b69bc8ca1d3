"""Background saves: one job at a time on its own thread, errors kept until someone is told.

:class:`AsyncWriter` runs each save job (write, checksum, fsync, publish; for a distributed save
also the agreement with the other ranks) on a fresh non-daemon thread and returns a
:class:`SaveHandle`. A job may start with a ``prepare`` step (the deferred part of the snapshot copy):
:meth:`AsyncWriter.wait_for_snapshot` returns once it is done, which is all the training loop has to
wait for before it changes its buffers again. The next job starts only after the previous one finished (the caller waits
for it first: the snapshot buffer the job reads is reused). An exception raised by a job is kept
and raised by the owner's next call (:meth:`AsyncWriter.wait` or :meth:`AsyncWriter.check`), or by
:meth:`SaveHandle.wait`; it is reported once. At interpreter exit Python waits for non-daemon
threads, so an unfinished save completes before the process ends; an error nobody was told about
by then is logged at exit (ERROR, under the ``ort_trainer`` logger: on stderr unless logging is
configured otherwise; exit cannot raise it).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from ._snapshot import HostSnapshot

logger = logging.getLogger(__name__)

__all__ = ["AsyncWriter", "SaveHandle"]


class SaveHandle:
    """The outcome of one save. A synchronous save returns a handle that is already done.

    ``wait()`` blocks until the save is published (or failed) and raises its error; ``done()`` says
    whether it has finished; ``result`` is what the job returned (e.g. the paths written).
    """

    def __init__(self, label: str, what: str | None = None) -> None:
        self.label = label
        self.what = what or f"the asynchronous save of {label}"  # how the exit report names it
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._finishing = False
        self._lock = threading.Lock()
        self.result: Any = None

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "pending"
        return f"SaveHandle({self.label!r}, {state})"

    @classmethod
    def completed(cls, label: str, result: Any = None) -> SaveHandle:
        handle = cls(label)
        handle._finish(result, None)
        return handle

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        """True once the save has finished with an error (without counting as reporting it)."""
        return (self._finishing or self._done.is_set()) and self._error is not None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the save is finished (``timeout`` seconds at most); raise its error; return its result."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save of {self.label} did not finish within {timeout} s")
        self._raise()
        return self.result

    def wait_unreported(self) -> None:
        """Block until the save is finished; raise its error only if nobody has been told about it yet."""
        self._done.wait()
        if not self._reported:
            self._raise()

    @property
    def error(self) -> BaseException | None:
        """The save's exception (None while pending or after a success); reading it counts as reporting it."""
        if self._error is not None:
            self._mark_reported()
        return self._error

    def _mark_reported(self) -> None:
        self._reported = True
        _UNREPORTED.discard(self)

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` when the save has finished, before :meth:`wait` returns: on the writer's
        thread, or now if it has already finished."""
        with self._lock:
            if not self._finishing:
                self._callbacks.append(fn)
                return
        self._done.wait()
        fn(self)

    def _raise(self) -> None:
        if self._error is not None:
            self._mark_reported()
            raise self._error

    def _finish(self, result: Any, error: BaseException | None) -> None:
        """Record the outcome, run the callbacks (their failure becomes the outcome), then release waiters."""
        self.result, self._error = result, error
        with self._lock:
            self._finishing = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except BaseException as exc:  # a callback's failure is the save's outcome too: never lost
                if self._error is None:
                    self._error = exc
        if self._error is not None and not self._reported:
            _UNREPORTED.add(self)
        self._done.set()


class AsyncWriter:
    """Runs save jobs one at a time in the background and holds the reusable host snapshot."""

    def __init__(self) -> None:
        self.snapshot = HostSnapshot()
        self._handle: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._snapshot_done = threading.Event()
        self._snapshot_done.set()

    @property
    def pending(self) -> SaveHandle | None:
        """The handle of the save still running (None if there is none)."""
        handle = self._handle
        return handle if handle is not None and not handle.done() else None

    def submit(self, job: Callable[[], Any], label: str, prepare: Callable[[], None] | None = None) -> SaveHandle:
        """Start ``prepare()`` then ``job()`` on a new thread (the previous job must be finished: call
        :meth:`wait` first). :meth:`wait_for_snapshot` returns once ``prepare`` is done."""
        if self.pending is not None:
            raise RuntimeError(f"a save of {self._handle.label} is still running; wait for it first")
        handle = SaveHandle(label)
        done = self._snapshot_done
        done.clear()

        def run() -> None:
            try:
                try:
                    if prepare is not None:
                        prepare()
                finally:
                    done.set()
                result = job()
            except BaseException as exc:  # kept for the owner's next call
                handle._finish(None, exc)
            else:
                handle._finish(result, None)

        self._handle = handle
        if _shutting_down():  # a thread started now would never be joined: save on this thread instead
            run()
            handle._mark_reported()  # raised here, at the call
            handle._raise()
            return handle
        thread = threading.Thread(target=run, name=f"ort_trainer-save {label}", daemon=False)
        try:
            thread.start()
        except BaseException as exc:  # e.g. "can't start new thread" at a memory or thread limit
            self._handle = None
            done.set()  # nothing will copy the buffers: training must not wait for it
            raise RuntimeError(
                f"cannot save {label} in the background: the save thread could not start ({exc}); nothing was "
                "written and training can go on (save with async_save=False, or free memory and try again)"
            ) from exc
        self._thread = thread
        return handle

    def wait_for_snapshot(self) -> None:
        """Block until the running save has copied everything it reads (the trainer may then change its buffers)."""
        self._snapshot_done.wait()

    def wait(self) -> None:
        """Block until the running save (if any) has finished; raise its error if not reported yet."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        """Raise the error of a finished save nobody has been told about (does not block)."""
        handle = self._handle
        if handle is not None and handle.done() and handle._error is not None and not handle._reported:
            handle._raise()


def _shutting_down() -> bool:
    """True once the interpreter is exiting: ``atexit`` hooks run after Python joined its threads
    (``threading._shutdown``), so a save thread started from one would be cut off mid-write."""
    return sys.is_finalizing() or bool(getattr(threading, "_SHUTTING_DOWN", False))


_UNREPORTED: set[SaveHandle] = set()  # failed saves whose error nobody has seen yet


def _report_unseen_errors() -> None:
    """At exit (after Python joined the save threads): print every save error nobody was told about."""
    for handle in sorted(_UNREPORTED, key=lambda h: h.label):
        handle._reported = True
        logger.error(
            "ort_trainer: %s failed after the last call that could report it: %s: %s",
            handle.what,
            type(handle._error).__name__,
            handle._error,
        )
    _UNREPORTED.clear()


atexit.register(_report_unseen_errors)
