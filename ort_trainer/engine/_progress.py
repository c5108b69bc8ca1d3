"""Progress of the one-time build: each phase logged at INFO with its duration, a tqdm bar on a terminal.

The first `train_step` of a real model exports it, builds the gradient graph and creates ONNX Runtime
sessions: at GPT-2 124M that is tens of seconds in which nothing else would be printed. Every phase
(`BuildProgress.phase`) is logged on the ``ort_trainer.engine._progress`` logger at INFO when it ends
("build phase 'export' took 4.21 s"), and the whole build once more at the end; when stderr is a
terminal a tqdm bar also shows which phase runs and for how long (refreshed every second, so a long
phase visibly ticks). The bar is removed when the build ends; the log lines stay.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["BuildProgress"]

logger = logging.getLogger(__name__)


class BuildProgress:
    """Times named phases of one build; ``what`` names the build in the log ("training graphs")."""

    def __init__(self, phases: int, what: str = "build"):
        self._what = what
        self._started = time.perf_counter()
        self.durations: dict[str, float] = {}
        self._bar = _terminal_bar(phases, what)
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run one phase: shown on the bar while it runs, logged with its duration when it ends."""
        started = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(f"{self._what}: {name}")
            self._start_ticking()
        try:
            yield
        finally:
            self._stop_ticking()
        seconds = time.perf_counter() - started
        self.durations[name] = self.durations.get(name, 0.0) + seconds
        logger.info("%s phase %r took %.2f s", self._what, name, seconds)
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> float:
        """End the build: log its total duration, remove the bar; returns the total in seconds."""
        total = time.perf_counter() - self._started
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.durations.items())
        logger.info("%s done in %.2f s (%s)", self._what, total, phases)
        return total

    def _start_ticking(self) -> None:
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="ort_trainer-build-progress", daemon=True)
        self._ticker.start()

    def _stop_ticking(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    def _tick(self) -> None:
        while not self._stop.wait(1.0):  # redraw the elapsed time while a long phase runs
            bar = self._bar
            if bar is not None:
                bar.refresh()


def _terminal_bar(total: int, what: str):
    """A tqdm bar on stderr when it is a terminal, else None (logging carries the progress then)."""
    stream = sys.stderr
    if stream is None or not hasattr(stream, "isatty") or not stream.isatty():
        return None
    from tqdm import tqdm  # noqa: PLC0415 - only on a terminal

    return tqdm(total=total, desc=what, unit="phase", file=stream, leave=False, bar_format=_FORMAT)


_FORMAT = "{desc} [{n_fmt}/{total_fmt} phases, {elapsed}]"
