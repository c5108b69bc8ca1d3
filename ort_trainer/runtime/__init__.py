"""ONNX Runtime plumbing that every session of ours shares (both engines' and ORTModule's).

* ``_devices``: `DeviceSpec` and `resolve_device`, the torch device and the execution providers of a session;
* ``_dlpack``: torch tensors as ``OrtValue``s and back without copies, on every onnxruntime release we support;
* ``_outputs``: `OutputBinding`, a session's outputs bound once (a run allocates only what it hands out), and
  `run_options`;
* ``_shared_arena``: one CPU arena for the sessions we make (a trainer's training and eval graphs, ORTModule's
  forward and backward);
* ``_fork_safety``: a process forked from one holding sessions frees and exits without hanging in ONNX Runtime;
* ``_native_logs``: ONNX Runtime's native INFO chatter kept quiet (what matters re-emitted through our logger);
* ``_memory``: a build's freed scratch returned to the OS.

It imports nothing of ours: the engine (``engine/`` and its wings) and ``module/`` (ORTModule) stand on it.
"""

from __future__ import annotations

from ._devices import DeviceSpec, resolve_device
from ._dlpack import DLPACK_ROUTE, from_ortvalue, to_ortvalue
from ._fork_safety import track
from ._memory import release_freed_memory
from ._native_logs import NO_GRADIENT_NODE_SUFFIX, quiet_native_info_logs
from ._outputs import OutputBinding, run_options
from ._shared_arena import use_shared_cpu_arena

__all__ = [
    "DLPACK_ROUTE",
    "NO_GRADIENT_NODE_SUFFIX",
    "DeviceSpec",
    "OutputBinding",
    "from_ortvalue",
    "quiet_native_info_logs",
    "release_freed_memory",
    "resolve_device",
    "run_options",
    "to_ortvalue",
    "track",
    "use_shared_cpu_arena",
]
