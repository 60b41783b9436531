"""Profiler tests: ``@pytest.mark.slow`` ones run only when asked for (``-m slow``).

The marker is declared in pyproject.toml ("run with -m slow"); this makes the
default run skip them, so ``pytest -q`` stays within its time budget.
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords and "tests/profiler" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
