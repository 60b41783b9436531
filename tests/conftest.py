"""Test set-up shared by every package's tests.

TensorFlow's logical CPU devices must be configured before the runtime starts,
so the whole session gets 8 of them (DESIGN.md: CPU logical devices stand in for
GPUs), configured the moment TensorFlow is first imported: tests that never import
it do not pay for it.
"""
from __future__ import annotations

import importlib.util
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# glibc reports heap corruption on the terminal, which CI has none of: say it on stderr, so
# that a worker that aborts leaves the reason in the log
os.environ.setdefault("LIBC_FATAL_STDERR_", "1")
# the CLI's output width comes from COLUMNS where it is set (a terminal's, or pytest-xdist's
# workers' 80): tests read the piped default (wide) unless they set it themselves
# (tests/cli/test_terminal.py does, per test)
os.environ.pop("COLUMNS", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NUM_LOGICAL_CPUS = 8


class _NoTopLevelStageFolders:
    """Refuse ``import apply`` (``planner``, ``profiler``, ``reports``) in tests.

    The repository root is on ``sys.path`` (for ``tests.``, ``examples.`` and
    ``benchmarks.``), so the stage folders would import as top-level packages beside
    the installed ``tfplan`` ones: two copies of every module. Everything imports
    them as ``tfplan.<stage>``; this makes a stray old-style import fail as it does
    for a user.
    """

    def find_spec(self, name, path=None, target=None):
        if path is None and name in ("apply", "planner", "profiler", "reports"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTopLevelStageFolders())


def configure_logical_cpus(tf) -> None:
    """Split the CPU into NUM_LOGICAL_CPUS logical devices (before the runtime starts)."""
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_LOGICAL_CPUS)])
    except RuntimeError:  # runtime already started by a plugin: keep what exists
        pass


class _ConfigureTensorFlowOnImport:
    """Configure the logical CPUs the moment some test (or module) imports TensorFlow.

    TensorFlow's runtime starts at its first op, not at ``import``, so configuring
    right after the import is always in time. Sessions that never import TensorFlow
    (most planner tests) do not pay for it.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            configure_logical_cpus(module)

        spec.loader.exec_module = exec_module
        return spec


if "tensorflow" in sys.modules:
    configure_logical_cpus(sys.modules["tensorflow"])
else:
    sys.meta_path.insert(0, _ConfigureTensorFlowOnImport())


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` tests run only when asked for (``-m slow``), in every package.

    The marker is declared in pyproject.toml ("run with -m slow"); the default run
    (``pytest -q``) skips them to stay within its time budget. Each one is a redundant
    combination (or a benchmark) whose feature a default test covers at small size.
    """
    import pytest

    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
