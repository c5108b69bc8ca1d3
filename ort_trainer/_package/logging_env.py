"""The ``ort_trainer`` logger: every module logs under it (``logging.getLogger(__name__)``).

We configure nothing by default: records of level WARNING and above reach stderr through Python's
last-resort handler (or through whatever handler the root logger has: ``import onnxruntime`` from
onnxruntime-training calls ``logging.basicConfig``), and an application's own logging configuration
applies as usual. ``ORT_TRAINER_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or a number)
sets the level of the ``ort_trainer`` logger at import and, if neither it nor the root logger has a
handler yet, adds one that writes ``ort_trainer.<module> LEVEL: message`` lines to stderr. That handler
steps aside for a record that a root handler configured later will print, so nothing prints twice.
"""

from __future__ import annotations

import logging
import os

__all__ = ["ENV_VAR", "LOGGER_NAME", "configure_from_env"]

LOGGER_NAME = "ort_trainer"
ENV_VAR = "ORT_TRAINER_LOG_LEVEL"


def _parse_level(text: str) -> int:
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise ValueError(f"{ENV_VAR}={text!r} is not a logging level; expected DEBUG, INFO, WARNING, ERROR or a number")
    return level


def configure_from_env(environ: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Apply ``ORT_TRAINER_LOG_LEVEL`` (if set) to the ``ort_trainer`` logger."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not text.strip():
        return
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(_parse_level(text))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = _UntilRootConfigured()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


class _UntilRootConfigured(logging.StreamHandler):
    """Stderr, for the records no root handler prints (one added later by the application or by a library's
    ``logging.basicConfig``: onnxruntime-training's import adds one); without it each record printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(LOGGER_NAME)
        root = logging.getLogger()
        if logger.propagate and any(record.levelno >= handler.level for handler in root.handlers):
            return  # the root's handler prints it
        super().emit(record)
