"""How the hardware micro-benchmarks take a time: paired differences of tf.functions.

Pipeline position: used by ``profiler.hw_compute`` and ``profiler.hw_comm``,
which ``profiler.hardware.profile_hardware`` runs. Imports TensorFlow lazily
(only numpy at module level).

Method. Each benchmark is a ``tf.function`` that returns a small slice of its
result; reading that slice back to the host (``.numpy()``) waits for the work
to finish on the device, so the wall time of one call covers it. A call also
pays a fixed cost -- Python dispatch, the executor's start, the read-back --
of about 0.3-0.5 ms here, far more than a small kernel. It is removed by timing
two functions that differ only in the work to be measured: ``f_hi`` does
``ops`` more operations than ``f_lo`` (1 + k chained matmuls against 1, or a
copy to another device against the same read on one device). After warm-up
calls (the first traces the function), the two are called alternately and the
time per operation is median(T_hi - T_lo) / ops over the pairs; alternating
pairs cancels drift and the median ignores the odd pause. Calls stop after
``max_repeats`` pairs, or once ``budget_s`` is spent and ``min_repeats`` pairs
are in.

k is chosen so that the extra work takes about ``target_s``: a probe times
2 against 1 operation for a first estimate d of one, and k = ceil(target_s / d)
clamped to [2, max_inner]. When the median difference is not positive (the
work is below the clock's noise), the upper bound median(T_hi) / (ops + ops_lo)
is recorded instead, with ``method="upper_bound"``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class TimingPolicy:
    """How hard each measured point is tried."""

    warmup: int = 2
    min_repeats: int = 3
    max_repeats: int = 15
    budget_s: float = 2.0  # per point, after warm-up
    target_s: float = 0.02  # extra work in f_hi, for choosing k
    max_inner: int = 64


QUICK = TimingPolicy(warmup=1, min_repeats=3, max_repeats=7, budget_s=0.3, target_s=0.005,
                     max_inner=64)
FULL = TimingPolicy()


@dataclass(frozen=True)
class Measured:
    seconds: float  # per operation
    method: str  # "difference" or "upper_bound"


def call_s(fn: Callable[[], Any]) -> float:
    """Wall time of one call, synchronised by reading its (small) result back."""
    start = time.perf_counter()
    out = fn()
    _read_back(out)
    return time.perf_counter() - start


def median_call_s(fn: Callable[[], Any], repeats: int) -> float:
    return float(np.median([call_s(fn) for _ in range(repeats)]))


def time_chain(make: Callable[[int], Callable[[], Any]], policy: TimingPolicy,
               max_k: int | None = None) -> Measured:
    """Seconds per operation of ``make(ops)``, a function doing ``ops`` chained operations.

    Chooses k (see the module docstring) from a probe: d = T(2) - T(1) estimates
    one operation, k = ceil(target_s / d) clamped to [2, max_inner] (max_inner
    when d is not positive) and to ``max_k``; then times 1 + k against 1.
    """
    f_lo, f_probe = make(1), make(2)
    for f in (f_lo, f_probe):  # the first call traces
        _read_back(f())
    d = median_call_s(f_probe, 3) - median_call_s(f_lo, 3)
    k = policy.max_inner if d <= 0 else math.ceil(policy.target_s / d)
    k = max(2, min(k, policy.max_inner, max_k or policy.max_inner))
    return paired_difference(make(1 + k), f_lo, k, policy, ops_lo=1)


def paired_difference(f_hi: Callable[[], Any], f_lo: Callable[[], Any], ops: int,
                      policy: TimingPolicy, ops_lo: int = 0) -> Measured:
    """Seconds per operation: median(T_hi - T_lo) / ops over alternating pairs.

    ``ops_lo`` is the number of measured operations ``f_lo`` itself does (1 for a
    chain of 1 vs 1 + k), used only for the upper bound.
    """
    for _ in range(policy.warmup):
        _read_back(f_hi())
        _read_back(f_lo())
    diffs, his = [], []
    start = time.perf_counter()
    while len(diffs) < policy.max_repeats:
        t_hi = call_s(f_hi)
        t_lo = call_s(f_lo)
        diffs.append(t_hi - t_lo)
        his.append(t_hi)
        if len(diffs) >= policy.min_repeats and time.perf_counter() - start > policy.budget_s:
            break
    per_op = float(np.median(diffs)) / ops
    if per_op > 0:
        return Measured(per_op, "difference")
    return Measured(float(np.median(his)) / (ops + ops_lo), "upper_bound")


def _read_back(out: Any) -> None:
    if isinstance(out, (list, tuple)):
        for o in out:
            _read_back(o)
    else:
        np.asarray(out)
