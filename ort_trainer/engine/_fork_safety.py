"""A process forked from a trainer exits without hanging in ONNX Runtime's thread pool.

A forked child inherits the parent's ONNX Runtime sessions, but not their intra-op worker threads. When the
child's interpreter shuts down and a session is freed, ORT (stock 1.31; seen with the autograd engine's
sessions) destroys its thread pool's condition variable, and glibc's ``pthread_cond_destroy`` waits for the
parent's waiters, which do not exist in the child: the child blocks on a futex forever (a ``multiprocessing``
worker, a DataLoader worker, an ``os.fork`` helper that merely exits; found by
tests/checkpoint/test_checkpoint_fork.py, issue S).

A session cannot run in the child anyway (its threads are gone), so the child keeps every session it inherited
alive for good: `track` registers each session we create, and at fork the child takes one more reference to
each (``Py_IncRef``), so none is ever freed there. The parent is untouched.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any

__all__ = ["track"]

_sessions: weakref.WeakSet = weakref.WeakSet()
_kept: list[Any] = []  # the child's extra references (never released)


def track(session: Any) -> Any:
    """Register an ONNX Runtime session (or any object holding one) to be kept alive in forked children."""
    _sessions.add(session)
    return session


def _keep_in_child() -> None:
    for session in list(_sessions):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(session))  # survives interpreter shutdown's clearing too
        _kept.append(session)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_in_child)
