"""A process forked from a trainer exits without hanging in ONNX Runtime.

A forked child inherits the parent's memory, ONNX Runtime's included, but none of its threads. Two things
then blocked a child for good (stock onnxruntime 1.31; tests/engine/test_fork_safety.py and
tests/engine/test_fork_exit.py):

1. Freeing an inherited session: ORT destroys its thread pool's condition variable, and glibc's
   ``pthread_cond_destroy`` waits for the parent's waiters, which do not exist in the child (a futex wait
   forever). A session cannot run in the child anyway (its threads are gone), so the child keeps every session
   it inherited alive for good: `track` registers each session we create, and at fork the child takes one more
   reference to each (``Py_IncRef``), so none is ever freed there. The parent is untouched.
2. Exiting normally (``sys.exit``, the end of the program; issue S5, item 7): after Python's own finalization,
   C ``exit()`` runs the native exit handlers, ORT's C++ static destructors among them, and one of those
   destroys a condition variable that a background thread of ORT (its telemetry's task dispatcher, started at
   ``import onnxruntime``) was waiting on in the parent: the same endless wait, whether or not the child trained
   (microsoft/onnxruntime PR 31961 covers thread pools, not this). Only ``ORT_DISABLE_TELEMETRY=1`` set before
   ``import onnxruntime`` avoids that thread; nothing after the import stops it. So at fork the child registers,
   with the C library, exit handlers that run before every native handler registered before the fork
   (they run in reverse order): HDF5 is closed (``H5close``, what HDF5's own exit handler does: files the child
   left open are flushed), C stdio is flushed (``fflush(NULL)``), and the process ends with ``_exit(status)``,
   the status ``exit()`` was given. Everything at the Python level still runs (``atexit`` callbacks, flushing
   ``sys.stdout``/``sys.stderr``, finalizers); native handlers registered in the child after the fork still run;
   only the pre-fork native handlers and static destructors are skipped, which is what a forked child may not
   run safely anyway. ``multiprocessing`` workers (fork start method) leave through ``os._exit`` and never
   reach them. Needs glibc's ``on_exit``; elsewhere the child exits as before (logged at debug level).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import weakref
from typing import Any

__all__ = ["track"]

_log = logging.getLogger("ort_trainer")

_sessions: weakref.WeakSet = weakref.WeakSet()
_kept: list[Any] = []  # the child's extra references (never released)
_HDF5_LIBRARY = re.compile(r"/libhdf5(-[0-9a-f]+)?\.so[.0-9]*$")  # h5py's bundled copy or the system's, not _hl


def track(session: Any) -> Any:
    """Register an ONNX Runtime session (or any object holding one) to be kept alive in forked children."""
    _sessions.add(session)
    return session


def _keep_in_child() -> None:
    for session in list(_sessions):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(session))  # survives interpreter shutdown's clearing too
        _kept.append(session)


def _loaded_hdf5() -> ctypes.CDLL | None:
    """The HDF5 library this process has loaded (h5py's), or None when HDF5 was never loaded."""
    if "h5py" not in sys.modules:
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if ".so" in line}
    except OSError as exc:
        _log.debug("fork child: cannot read /proc/self/maps to find HDF5: %s", exc)
        return None
    for path in sorted(paths):
        if _HDF5_LIBRARY.search(path):
            try:
                library = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
            except OSError as exc:
                _log.debug("fork child: cannot open the loaded HDF5 library %s: %s", path, exc)
                continue
            if hasattr(library, "H5close"):
                return library
    return None


def _end_child_before_native_exit_handlers() -> None:
    """In a forked child: make C ``exit(status)`` close HDF5, flush C stdio and ``_exit(status)`` before it
    reaches any native exit handler inherited from the parent (see the module docstring, point 2)."""
    libc = ctypes.CDLL(None)
    if not all(hasattr(libc, name) for name in ("on_exit", "__cxa_atexit", "_exit", "fflush")):
        _log.debug("fork child: no glibc on_exit; ONNX Runtime's exit handlers run at exit")
        return
    libc.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    # exit() runs handlers last-registered first: H5close, then fflush(NULL), then _exit(status)
    handlers = [(libc.on_exit, libc._exit), (libc.__cxa_atexit, libc.fflush)]  # on_exit passes the status
    hdf5 = _loaded_hdf5()
    if hdf5 is not None:
        handlers.append((libc.__cxa_atexit, hdf5.H5close))
    for register, function in handlers:
        address = ctypes.cast(function, ctypes.c_void_p)
        failed = register(address, None) if register is libc.on_exit else register(address, None, None)
        if failed:
            _log.debug("fork child: registering a native exit handler failed; ONNX Runtime's run at exit")
            return


def _after_fork_in_child() -> None:
    _keep_in_child()
    _end_child_before_native_exit_handlers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
