"""Peak memory of a few training steps, with a sentence saying which measure it is.

Pipeline position: helper of ``profiler.measure``, which calls
``before_first_step``, ``before_measured_steps`` and ``peak`` around its steps.
The measure depends on what this process can see:

* ``allocator``: ``tf.config.experimental.get_memory_info(device)['peak']``
  after ``reset_memory_stats``: bytes TensorFlow's allocator held at the peak
  of the measured steps, weights and optimizer slots included. Always there on
  a GPU; on the CPU only when the process started with
  ``TF_CPU_ALLOCATOR_USE_BFC=true`` (TensorFlow's default CPU allocator keeps
  no counter).
* ``rss`` (Linux): peak resident set size during warm-up and steps (``VmHWM``
  in ``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs``)
  minus the RSS before the first step: what the steps added (gradients,
  activations, temporaries, first-run caches, malloc slack); weights and
  optimizer slots were resident before and are not in it.
* ``maxrss`` (elsewhere): growth of ``ru_maxrss``, the lifetime peak: a lower
  bound, 0 when the process peaked higher earlier.
"""
from __future__ import annotations

import contextlib
import resource


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryProbe:
    """Peak memory over a window: TensorFlow's allocator where it counts, else RSS growth."""

    def __init__(self, device: str | None) -> None:
        import tensorflow as tf

        self._tf = tf
        self.device = device or "CPU:0"
        try:
            tf.config.experimental.get_memory_info(self.device)
            self.kind = "allocator"
        except ValueError:  # CPU without TF_CPU_ALLOCATOR_USE_BFC=true
            self.kind = "rss" if _proc_status_bytes("VmHWM") is not None else "maxrss"
        self._baseline = 0

    def before_first_step(self) -> None:
        if self.kind == "rss":
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
            self._baseline = _proc_status_bytes("VmRSS") or 0
        elif self.kind == "maxrss":
            self._baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def before_measured_steps(self) -> None:
        if self.kind == "allocator":
            self._tf.config.experimental.reset_memory_stats(self.device)

    def peak(self) -> tuple[int, str]:
        if self.kind == "allocator":
            peak = int(self._tf.config.experimental.get_memory_info(self.device)["peak"])
            return peak, (f"tf.config.experimental.get_memory_info('{self.device}')['peak'] "
                          "over the unprofiled steps: bytes held by TensorFlow's allocator at "
                          "the peak, weights and optimizer slots included")
        if self.kind == "rss":
            peak = (_proc_status_bytes("VmHWM") or 0) - self._baseline
            return max(peak, 0), (
                "process peak RSS during warm-up and steps minus RSS before the first step "
                "(Linux VmHWM reset via /proc/self/clear_refs): gradients, activations, "
                "temporaries and first-run caches; weights and optimizer slots were resident "
                "before and are not included. TensorFlow keeps no CPU allocator counter "
                "unless the process starts with TF_CPU_ALLOCATOR_USE_BFC=true")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._baseline
        return max(peak, 0), ("growth of the process's lifetime peak RSS (ru_maxrss) during "
                              "warm-up and steps: a lower bound (0 when an earlier peak was "
                              "higher)")
