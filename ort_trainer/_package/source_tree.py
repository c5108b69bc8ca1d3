"""``import ort_trainer`` from a source checkout: find ``checkpoint``, ``optim`` and ``amp`` at the repository root.

The installed package holds ``ort_trainer/checkpoint``, ``ort_trainer/optim`` and ``ort_trainer/amp``;
in the repository those folders sit at the top, next to ``ort_trainer/`` (``setup.py`` maps them with
``package_dir``). Python run in the repository root finds the local ``ort_trainer/`` folder first,
whatever is installed, and without help would not find its three subpackages. :func:`install` adds a
finder for exactly those three names, and only when the folder it was imported from lacks them. It goes
first in ``sys.meta_path``: an editable install of another checkout (a second git worktree run with
``PYTHONPATH=<worktree>``) has a finder of its own for the same names, which would otherwise mix the
worktree's trainer with the other checkout's ``checkpoint``, ``optim`` and ``amp``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__ = ["SUBPACKAGES", "install"]

SUBPACKAGES = ("checkpoint", "optim", "amp")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``ort_trainer.<sub>`` in ``<root>/<sub>`` for the three mapped subpackages, nothing else."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        package, _, sub = fullname.partition(".")
        if package != "ort_trainer" or sub not in SUBPACKAGES:
            return None
        init = self.root / sub / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install(package_file: str) -> None:
    """Register the finder if ``ort_trainer`` was imported from a source tree (no-op for installs)."""
    here = Path(package_file).resolve().parent
    root = here.parent
    if (here / "checkpoint").is_dir() or not (root / "setup.py").is_file():
        return  # an installed package (or an editable install's own finder maps the folders)
    if not all((root / sub / "__init__.py").is_file() for sub in SUBPACKAGES):
        return
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeFinder(root))  # before an editable install of another checkout
