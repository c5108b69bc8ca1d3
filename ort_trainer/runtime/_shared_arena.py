"""One CPU arena in ONNX Runtime's environment, shared by the sessions we make.

Each ``InferenceSession`` keeps an arena of its own by default and never gives its chunks back between runs.
A trainer's training and eval sessions, or `ORTModule`'s forward and backward sessions, then hold their
scratch side by side although only one of them runs at a time. Registered once per process in ORT's
environment (``create_and_register_allocator``) and chosen per session (``session.use_env_allocators``), one
arena serves them all (GPT-2 124M `ORTModule`: peak and steady RSS -274 MiB). Only for session options we make:
a user's own ``SessionOptions`` keep their own allocator settings.
"""

from __future__ import annotations

import functools
import logging

import onnxruntime as ort

__all__ = ["use_shared_cpu_arena"]

_log = logging.getLogger("ort_trainer")


def use_shared_cpu_arena(options: ort.SessionOptions) -> bool:
    """Let the sessions made with ``options`` take CPU memory from the environment's shared arena; False
    (``options`` unchanged) when ONNX Runtime refuses to register it."""
    if not _registered():
        return False
    options.add_session_config_entry("session.use_env_allocators", "1")
    return True


@functools.cache
def _registered() -> bool:
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    try:
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's default arena settings
    except Exception as error:  # noqa: BLE001 - ORT raises one class (Fail) for every refusal
        if "already" in str(error).lower():  # registered before (by the user): sessions share that one
            return True
        _log.info("ORT environment allocator not registered (%s): each session keeps its own arena", error)
        return False
    return True
