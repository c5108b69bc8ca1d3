"""Silence ONNX Runtime's native INFO chatter while building graphs.

`get_optimized_model` and the gradient builder log every graph transformer at INFO level straight to
file descriptor 2, ignoring `set_default_logger_severity`. We capture fd 2 around those calls and
re-emit them as records of this module's logger (under ``ort_trainer``): ONNX Runtime's ``[E:``/``[F:``
lines as ERROR, its INFO/VERBOSE lines as DEBUG (dropped unless that level is enabled), anything else as
WARNING, so users still see what matters. The gradient builder's warning about weight consumers that no
gradient reaches is DEBUG when every node it names ends with `NO_GRADIENT_NODE_SUFFIX`: our graphs build such
nodes on purpose (``graph.onnxblock._embedding``: a padding row read without a gradient).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["NO_GRADIENT_NODE_SUFFIX", "quiet_native_info_logs"]

NO_GRADIENT_NODE_SUFFIX = "/no_gradient"  # node names of ours that no gradient is meant to reach
_UNREACHABLE = "Following nodes are unreachable for gradient back propagation:"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_INFO_MARKERS = ("[I:onnxruntime", "[V:onnxruntime")
_ERROR_MARKERS = ("[E:onnxruntime", "[F:onnxruntime")
# the name users configure (docs/logging.md), kept from before this module moved out of diagnosis/
logger = logging.getLogger("ort_trainer.diagnosis._native_logs")


@contextlib.contextmanager
def quiet_native_info_logs() -> Iterator[None]:
    """Redirect fd 2 to a temp file for the block; forward non-INFO lines to stderr afterwards."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except OSError:  # no usable fd 2 (embedded interpreters): nothing to silence
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if line:
                    logger.log(_level(line), "%s", line)


def _level(line: str) -> int:
    if any(marker in line for marker in _INFO_MARKERS) or _only_ours_unreachable(line):
        return logging.DEBUG
    return logging.ERROR if any(marker in line for marker in _ERROR_MARKERS) else logging.WARNING


def _only_ours_unreachable(line: str) -> bool:
    """The gradient builder's "unreachable nodes" warning, naming only nodes we made unreachable on purpose."""
    if _UNREACHABLE not in line:
        return False
    names = [n.strip() for n in _ANSI.sub("", line.split(_UNREACHABLE, 1)[1]).split(",")]
    names = [n for n in names if n]
    return bool(names) and all(n.endswith(NO_GRADIENT_NODE_SUFFIX) for n in names)
