"""The newest release of each dependency that breaks us most easily which CI has run, and which installed ones
are newer (``python -m ort_trainer`` says so).

``NEWEST_TESTED`` is raised by hand after ``make test-latest`` (a fresh venv with the newest versions the declared
ranges admit) passes on a new release; ``make test-latest`` prints the versions it ran and names each one newer than
this record, so the record and what CI saw cannot drift apart silently. The README's "Version ranges" section is
the policy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import metadata

__all__ = ["NEWEST_TESTED", "newer_than_tested", "release"]

# distribution -> the newest version `make test-latest` has passed on (torch: the CPU build in `make test`, the
# PyPI build, CUDA included, in `make test-latest`)
NEWEST_TESTED = {
    "torch": "2.14.1",
    "onnxruntime": "1.32.0",
    "onnxscript": "0.7.2",
    "onnx": "1.23.2",
    "onnx-ir": "1.1.0",
}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.14.1+cpu" -> (2, 14, 1), "1.33.0.dev2026" -> (1, 33, 0)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    if numbers is None:
        raise ValueError(f"version {version!r} does not start with a numeric release (MAJOR[.MINOR[.PATCH]])")
    return tuple(int(part) for part in numbers[0].split("."))


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def newer_than_tested(installed: Callable[[str], str | None] = _installed) -> dict[str, tuple[str, str]]:
    """``{distribution: (installed version, newest tested)}`` for each one installed in a newer release than CI has
    run. ``installed`` maps a distribution name to its version or None (default: this environment's metadata)."""
    newer = {}
    for name, tested in [*NEWEST_TESTED.items(), ("onnxruntime-gpu", NEWEST_TESTED["onnxruntime"])]:
        version = installed(name)
        if version is not None and release(version) > release(tested):
            newer[name] = (version, tested)
    return newer
