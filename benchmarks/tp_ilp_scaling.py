"""Benchmark: tensor-parallel ILP solve time, 32 vs 128 identical transformer blocks.

Issue 4 asks that solve time for 32 vs 128 identical blocks differ by less than 2x.
With ``block_of`` the blocks share variables (planner.tp_ilp), so the ILP has the
same size at any depth; without it (every layer its own choice) it grows with depth.
Each block is a transformer layer as the planner sees it: LayerNorm, attention
(replicate|heads), LayerNorm, Dense up (replicate|column|row), Dense down (same).

    .venv/bin/python benchmarks/tp_ilp_scaling.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfplan.planner import milp  # noqa: E402
from tfplan.core.cluster import LinkSpec  # noqa: E402
from tfplan.planner.tp_ilp import (Collective, SplitOption, TPEdge, TPLayer, TPProblem,  # noqa: E402
                            ilp_tp)

LINK = LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=5e-6)  # NVLink-class
DEGREE, HIDDEN, TOKENS = 8, 4096, 8192
ACT = 2.0 * TOKENS * HIDDEN  # bf16 activation of one layer, bytes


def _block() -> list[TPLayer]:
    norm = (SplitOption("replicate", 2e-5, ACT),)
    attn_w, mlp_w = 4 * HIDDEN * HIDDEN * 16.0, 8 * HIDDEN * HIDDEN * 16.0  # state bytes
    attn_t, mlp_t = 4e-3, 8e-3
    attn = (SplitOption("replicate", attn_t, attn_w + ACT),
            SplitOption("heads", attn_t / DEGREE, attn_w / DEGREE + ACT,
                        (Collective("all-reduce", "forward", ACT),
                         Collective("all-reduce", "backward", ACT))))

    def dense(out_factor: int, time_s: float):
        w, out = mlp_w / 2, ACT * out_factor
        return (SplitOption("replicate", time_s, w + out),
                SplitOption("column", time_s / DEGREE, w / DEGREE + out / DEGREE,
                            (Collective("all-reduce", "backward", ACT),)),
                SplitOption("row", time_s / DEGREE, w / DEGREE + out,
                            (Collective("all-reduce", "forward", out),)))

    return [TPLayer("ln1", norm), TPLayer("attn", attn), TPLayer("ln2", norm),
            TPLayer("up", dense(4, mlp_t / 2)), TPLayer("down", dense(1, mlp_t / 2))]


def problem(blocks: int, share: bool, cap_bytes: float | None) -> TPProblem:
    layers, block_of = [], {}
    for b in range(blocks):
        for i, layer in enumerate(_block()):
            name = f"block{b}.{layer.name}"
            layers.append(TPLayer(name, layer.options))
            block_of[name] = ("transformer", i)
    names = [l.name for l in layers]
    sizes = {"up": 4 * ACT}
    edges = tuple(TPEdge(u, v, sizes.get(u.split(".")[1], ACT)) for u, v in zip(names, names[1:]))
    return TPProblem(tuple(layers), edges, DEGREE, LINK, cap_bytes, block_of if share else {})


_HIGHS_S: list[float] = []


def _timed_solve(original):
    def solve(self, time_limit_s):
        t0 = time.perf_counter()
        result = original(self, time_limit_s)
        _HIGHS_S.append(time.perf_counter() - t0)
        return result
    return solve


# HiGHS's own time, apart from building the rows and re-checking the answer (both
# linear in the layers, pure Python).
milp.Milp.solve = _timed_solve(milp.Milp.solve)


def timed(p: TPProblem, repeats: int = 15) -> tuple[float, float, object]:
    """Median end-to-end seconds of ilp_tp, median HiGHS seconds, the plan."""
    times, plan = [], None
    _HIGHS_S.clear()
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = ilp_tp(p)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.median(_HIGHS_S), plan


def main() -> None:
    print(f"{'blocks':>6} {'shared':>6} {'memory':>7} {'layers':>6} {'ilp_tp s':>9} "
          f"{'HiGHS s':>8}  splits of block 0")
    results = {}
    for share in (True, False):
        for cap_name in ("ample", "tight"):
            for blocks in (32, 128, 512):
                # tight: 0.68 GB per block, between the smallest choice (0.65 GB) and the
                # unconstrained optimum (0.70 GB), so memory binds
                cap = None if cap_name == "ample" else blocks * 0.68e9
                total, highs, plan = timed(problem(blocks, share, cap))
                results[share, cap_name, blocks] = (total, highs)
                first = [sp for _, sp in plan.split_of_layer[:5]]
                print(f"{blocks:>6} {str(share):>6} {cap_name:>7} {5 * blocks:>6} {total:>9.4f} "
                      f"{highs:>8.4f}  {first}  ({plan.solver.rsplit(', ', 1)[1]})")
    for share in (True, False):
        for cap_name in ("ample", "tight"):
            (t32, h32), (t128, h128) = results[share, cap_name, 32], results[share, cap_name, 128]
            print(f"shared={share!s:5} {cap_name}: 128/32 blocks ratio end-to-end "
                  f"{t128 / t32:.2f}, HiGHS {h128 / h32:.2f}")
    print("(end-to-end includes building the rows and re-checking every layer, pure Python and "
          "linear in depth; at a few ms in all, fixed overheads make ratios noisy)")


if __name__ == "__main__":
    main()
