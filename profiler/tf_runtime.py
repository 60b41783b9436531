"""Importing TensorFlow without its start-up noise on the user's terminal.

Pipeline position: used by every command-line entry point that needs
TensorFlow (the ``plan`` CLI, ``examples/train.py``). TensorFlow's C++ runtime
writes lines such as "Could not find cuda drivers" and "failed call to cuInit"
straight to file descriptor 2 on machines without a GPU, before
TF_CPP_MIN_LOG_LEVEL takes effect. ``import_tensorflow()`` captures fd 2 while
TensorFlow loads and enumerates its physical devices, then replays every line
that is not one of those known start-up messages, so real errors still show.
"""
from __future__ import annotations

import os
import sys
import tempfile
from types import ModuleType

KNOWN_STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "cudart_stub.cc",
    "cuda_platform.cc",
    "cpu_feature_guard.cc",
    "To enable the following instructions",
    "rebuild TensorFlow with the appropriate compiler flags",
    "Unable to register cu",
    "computation_placer.cc",
    "TF-TRT Warning",
)


def import_tensorflow() -> ModuleType:
    """``import tensorflow`` with its known start-up messages filtered out of stderr."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow as tf
            tf.config.list_physical_devices()  # GPU probing prints here; runtime not started
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        kept = [line for line in capture.read().decode(errors="replace").splitlines()
                if line.strip() and not any(n in line for n in KNOWN_STARTUP_NOISE)]
    for line in kept:
        sys.stderr.write(line + "\n")
    return tf
