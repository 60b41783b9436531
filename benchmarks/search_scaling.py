"""Benchmark: full strategy-search time for a GPT of 32 vs 128 identical blocks.

Pipeline position: outside the pipeline; it runs profiler -> planner.search the way
``plan analyze`` does. Issue 4 asks that the search (with the tensor-parallel ILP of
``planner.tp_splits`` choosing every layer's split) take less than 2x as long for 128
identical transformer blocks as for 32: identical blocks share the ILP's variables.

Each GPT (``benchmarks/profile_gpt.build_gpt``: Embedding, blocks of LayerNorm,
MultiHeadAttention, Add, LayerNorm, Dense 4h, Dense h, Add; LayerNorm and an untied
head) is profiled symbolically under mixed_float16 with Adam at batch 1, with
identical blocks traced once and copied (``profiler.repeats``; both depths are over
``REPEAT_BLOCKS_MIN_LAYERS`` = 200 layers, and ``repeat_blocks=True`` is passed to both
so they are made the same way). Then ``planner.search.search`` runs on the cluster
(default 64 nodes x 8 A100-80GB, global batch 1024) and is timed end to end; the
tensor-parallel ILP (``planner.tp_splits.solve_splits`` on a fresh Pricer, for every
tp dividing the node) is timed apart, split into building the TPProblem (repeated-block
detection included) and ``tp_ilp.ilp_tp``'s solve.

Run:  .venv/bin/python benchmarks/search_scaling.py [--blocks 32,128 --hidden 1024 ...]
      [--cache out/search_scaling] [--cprofile 25]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def profile_gpt(blocks: int, hidden: int, heads: int, vocab: int, seq: int, cache: str | None):
    """The GPT's ModelProfile (read from ``cache`` when it was written there before)."""
    import json

    from tfplan.profiler.model_profile import ModelProfile
    path = cache and os.path.join(cache, f"gpt_{blocks}x{hidden}_h{heads}_v{vocab}_s{seq}.json")
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return ModelProfile.from_dict(json.load(f)), 0.0
    from tfplan.profiler.tf_runtime import import_tensorflow
    tf = import_tensorflow()
    import keras

    from benchmarks.profile_gpt import build_gpt
    from tfplan.profiler.static import profile_model
    start = time.perf_counter()
    before = keras.config.dtype_policy().name
    keras.config.set_dtype_policy("mixed_float16")  # built under the policy: exact bytes
    try:
        with tf.Graph().as_default():
            model = build_gpt(blocks, hidden, heads, vocab, seq)
            profile = profile_model(model, 1, precision="mixed_float16", optimizer="adam",
                                    name="gpt", repeat_blocks=True)
    finally:
        keras.config.set_dtype_policy(before)
    took = time.perf_counter() - start
    if path:
        os.makedirs(cache, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(profile.to_dict(), f)
    return profile, took


def _timing_highs():
    """Wrap ``milp.Milp.solve`` (HiGHS's own run) to record its seconds."""
    from tfplan.planner import milp
    seconds: list[float] = []
    original = milp.Milp.solve

    def solve(self, time_limit_s):
        t0 = time.perf_counter()
        try:
            return original(self, time_limit_s)
        finally:
            seconds.append(time.perf_counter() - t0)

    milp.Milp.solve = solve
    return seconds, lambda: setattr(milp.Milp, "solve", original)


def time_tp_ilp(profile, cluster, global_batch: int, repeats: int) -> dict[int, dict]:
    """Median seconds per tp of: building the TPProblem, ilp_tp (and HiGHS within it),
    solve_splits end to end."""
    from tfplan.planner.candidates import divisors
    from tfplan.planner.context import search_context
    from tfplan.planner.pricing import Pricer
    from tfplan.planner.tp_ilp import ilp_tp
    from tfplan.planner.tp_splits import reference_samples, solve_splits, tp_problem

    ctx = search_context(profile, cluster, global_batch)
    out = {}
    highs_s, restore = _timing_highs()
    for tp in [t for t in divisors(cluster.devices_per_node) if t > 1]:
        samples = reference_samples(global_batch, cluster.num_devices, tp)
        build, solve, total, highs = [], [], [], []
        for _ in range(repeats):
            pricer = Pricer(ctx)
            a = pricer.arrays(1, samples)
            times = a["fwd"] + a["bwd"]
            t0 = time.perf_counter()
            problem = tp_problem(profile, cluster, tp, layer_time_s=times, samples=samples)
            t1 = time.perf_counter()
            highs_s.clear()
            plan = ilp_tp(problem, time_limit_s=pricer.tp_time_limit_s)
            t2 = time.perf_counter()
            highs.append(sum(highs_s))
            choice = solve_splits(profile, cluster, tp, layer_time_s=times, samples=samples,
                                  time_limit_s=pricer.tp_time_limit_s)
            t3 = time.perf_counter()
            build.append(t1 - t0)
            solve.append(t2 - t1)
            total.append(t3 - t2)
        groups = len({problem.block_of.get(l.name, l.name) for l in problem.layers})
        out[tp] = {"build_s": statistics.median(build), "ilp_s": statistics.median(solve),
                   "highs_s": statistics.median(highs),
                   "total_s": statistics.median(total), "groups": groups,
                   "splits": choice.splits, "solver": choice.solver, "plan": plan}
    restore()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="32,128")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--cluster", default="64x8xA100-80GB")
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="searches timed per depth")
    parser.add_argument("--ilp-repeats", type=int, default=5, help="ILP solves timed per tp")
    parser.add_argument("--cache", default=None, help="directory to keep the profiles in")
    parser.add_argument("--cprofile", type=int, default=0,
                        help="print the N most expensive functions of the deepest search")
    args = parser.parse_args(argv)

    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search

    cluster = parse_cluster(args.cluster)
    depths = [int(b) for b in args.blocks.split(",")]
    search_s, ilp_s, highs_total = {}, {}, {}
    for blocks in depths:
        profile, took = profile_gpt(blocks, args.hidden, args.heads, args.vocab, args.seq,
                                    args.cache)
        repeated = [w for w in profile.warnings if "repeated blocks" in w]
        print(f"--- {blocks} blocks: {len(profile.layers)} layers, {profile.params:,} params, "
              f"profiled in {took:.1f} s" + (" (cached)" if not took else ""))
        print(f"    {repeated[0][:110] if repeated else 'NO repeated blocks detected'}")
        times, result = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = search(profile, cluster, args.global_batch)
            times.append(time.perf_counter() - t0)
        search_s[blocks] = statistics.median(times)
        print(f"    search {search_s[blocks]:.2f} s (median of {args.repeats}); "
              f"{result.evaluated} strategies; chosen {result.chosen.name}")
        print(f"    chosen solver: {result.chosen.solver}")
        ilp = time_tp_ilp(profile, cluster, args.global_batch, args.ilp_repeats)
        ilp_s[blocks] = sum(r["total_s"] for r in ilp.values())
        highs_total[blocks] = sum(r["highs_s"] for r in ilp.values())
        for tp, r in ilp.items():
            first = tuple(k or "-" for k in r["splits"][:9])
            print(f"    tp={tp}: build {r['build_s'] * 1e3:6.1f} ms, ilp_tp {r['ilp_s'] * 1e3:5.1f}"
                  f" ms (HiGHS {r['highs_s'] * 1e3:4.1f} ms), solve_splits "
                  f"{r['total_s'] * 1e3:6.1f} ms, {r['groups']} choice groups;"
                  f" splits {first} ... {r['splits'][-1] or '-'}")
        if args.cprofile and blocks == max(depths):
            prof = cProfile.Profile()
            prof.runcall(search, profile, cluster, args.global_batch)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)
    if len(depths) >= 2:
        lo, hi = min(depths), max(depths)
        print(f"search time {hi}/{lo} blocks: {search_s[hi]:.2f} / {search_s[lo]:.2f} s = "
              f"{search_s[hi] / search_s[lo]:.2f} (target < 2)")
        print(f"tp ILP (solve_splits, all tp) {hi}/{lo} blocks: {ilp_s[hi] * 1e3:.1f} / "
              f"{ilp_s[lo] * 1e3:.1f} ms = {ilp_s[hi] / ilp_s[lo]:.2f}; HiGHS alone "
              f"{highs_total[hi] * 1e3:.1f} / {highs_total[lo] * 1e3:.1f} ms = "
              f"{highs_total[hi] / highs_total[lo]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
