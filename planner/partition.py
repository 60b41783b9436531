"""Stage balancing: contiguous runs of a layer order with even work per pipeline device.

Pipeline position: ``planner.pricing.Pricer.partition`` splits the topological layer
order into pp x v runs (run k on pipeline device k % pp) with these functions, on the
per-layer work the cost model priced; pure functions of a weight sequence.
"""
from __future__ import annotations

import bisect
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4096)
def min_max_partition(weights: tuple[float, ...], parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``weights`` into ``parts`` non-empty contiguous runs minimising the largest sum.

    Bisection on the bottleneck T with a greedy fill that leaves at least one item
    per remaining part (feasible iff some partition has max <= T, weights >= 0), to a
    relative precision of 1e-7 (``bisect`` on a Python list: the fill is the search's
    inner loop).
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} parts of {n} items; expected 1 <= parts <= items")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def fill(t: float):
        bounds, lo = [], 0
        slack = t * (1 + 1e-12) + 1e-18
        for s in range(parts):
            if s == parts - 1:
                hi = n
            else:
                hi = bisect.bisect_right(prefix, prefix[lo] + t) - 1
                hi = min(max(lo + 1, hi), n - (parts - s - 1))
            if prefix[hi] - prefix[lo] > slack:
                return None
            bounds.append((lo, hi))
            lo = hi
        return tuple(bounds)

    lo_t, hi_t = max(weights), prefix[-1]
    best = fill(hi_t) if parts == 1 else None
    for _ in range(60):
        if best is not None and hi_t - lo_t <= 1e-7 * hi_t:
            break
        mid = (lo_t + hi_t) / 2
        got = fill(mid)
        if got is None:
            lo_t = mid
        else:
            best, hi_t = got, mid
    if best is None:
        best = fill(hi_t) or fill(prefix[-1] * 1.000001)
    return best


def even_partition(weights: tuple[float, ...], parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``weights`` into ``parts`` non-empty contiguous runs whose sums are each as
    close as the item boundaries allow to total / parts: cut k at the prefix sum nearest
    k x total / parts. Unlike the min-max split (which packs the early runs full and can
    leave the last ones nearly empty), every run gets about the same work -- what an
    interleaved pipeline needs, where a device's load is the sum of v runs."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} parts of {n} items; expected 1 <= parts <= items")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    cuts, lo = [0], 0
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        i = int(np.searchsorted(prefix, target))
        if i > 0 and abs(prefix[i - 1] - target) <= abs(prefix[min(i, n)] - target):
            i -= 1
        i = min(max(i, lo + 1), n - (parts - k))  # non-empty runs on both sides
        cuts.append(i)
        lo = i
    cuts.append(n)
    return tuple((cuts[k], cuts[k + 1]) for k in range(parts))


def device_loads(weights: np.ndarray, bounds: tuple[tuple[int, int], ...], pp: int) -> list[float]:
    """Work of each of ``pp`` pipeline devices when run k of ``bounds`` is on device k % pp."""
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    loads = [0.0] * pp
    for k, (lo, hi) in enumerate(bounds):
        loads[k % pp] += float(prefix[hi] - prefix[lo])
    return loads
