"""Test set-up shared by every package's tests.

TensorFlow's logical CPU devices must be configured before the runtime starts,
so the whole session gets 8 of them here (DESIGN.md: CPU logical devices stand
in for GPUs). Tests that never import TensorFlow do not pay for this.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NUM_LOGICAL_CPUS = 8


def pytest_configure(config):
    from tfplan.profiler.tf_runtime import import_tensorflow

    tf = import_tensorflow()  # without the start-up noise of a machine with no GPU

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_LOGICAL_CPUS)])
    except RuntimeError:  # runtime already started by a plugin: keep what exists
        pass
