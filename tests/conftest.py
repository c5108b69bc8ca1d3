"""Fixtures every test folder shares (the builders themselves live in ``tests/builders.py``, so that
spawned worker scripts and helper modules can import them too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.builders import legacy_trainer_options, mlp_trainer


@pytest.fixture
def make_trainer() -> Callable[..., Any]:
    """`tests.builders.mlp_trainer`: ``make_trainer(model=None, *, config=None, seed=0, hidden=16, **options)``."""
    return mlp_trainer


@pytest.fixture
def trainer_options() -> dict[str, Any]:
    """A fresh copy of the legacy ``trainer_options`` record of a one-process Adam run."""
    return legacy_trainer_options()
