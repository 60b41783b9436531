"""Benchmark: predicted vs published TFLOP/s per GPU for Megatron-LM's weak-scaling table.

Pipeline position: outside the pipeline; it runs profiler -> planner the way
``plan analyze --fix`` does, on the GPT configurations of Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC'21, Table 1 (``/work/shared/reference/megatron-2021-table1.csv``).

For each row: the GPT (``examples/gpt_megatron.gpt``) is profiled symbolically at
batch 1, sequence 2048, mixed_float16, Adam (identical blocks traced once and
copied: ``profiler.repeats``); the cluster is ceil(gpus/8) nodes of 8xA100-80GB;
the published strategy (tp, pp, dp = gpus/(tp*pp), global batch, full
recomputation; where pp > 1 the paper's interleaved schedule with micro-batch size 1,
the number of chunks per GPU (2-4, not given in the table) left to the planner; where
pp = 1 the micro-batch size too) is priced by ``planner.search`` with ``fix``;
the predicted step time becomes TFLOP/s per GPU with the paper's Eq. 3,
F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration, F / (t_step * gpus).
Then the unconstrained search runs on the same cluster and its plan must be
predicted at least as fast.

Run:  .venv/bin/python benchmarks/megatron_table1.py [--rows 0,1,2] [--no-search]
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TABLE = "/work/shared/reference/megatron-2021-table1.csv"
SEQ, VOCAB = 2048, 51200


def read_table(path: str = TABLE) -> list[dict[str, float]]:
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if not line.startswith("#")]
    return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(rows)]


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int,
                                 vocab: int) -> float:
    """Narayanan et al., SC'21, Eq. 3 (full recomputation included):
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    return 96 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def published_strategy(row: dict[str, float]) -> dict:
    tp, pp, gpus = int(row["tensor_parallel"]), int(row["pipeline_parallel"]), int(row["gpus"])
    dp = gpus // (tp * pp)
    fix = {"dp": dp, "tp": tp, "pp": pp, "recompute": "full"}
    if pp > 1:  # the paper's interleaved schedule; chunks per GPU (2-4) as the planner prices best
        fix.update(schedule="interleaved", microbatch_size=1)
    return fix


def cluster_for(gpus: int):
    from tfplan.core.presets import parse_cluster
    return parse_cluster(f"{math.ceil(gpus / 8)}x8xA100-80GB")


def profile_row(row: dict[str, float], layers: int | None = None):
    """The row's GPT profiled symbolically (``layers`` overrides the depth)."""
    from tfplan.profiler.tf_runtime import import_tensorflow
    tf = import_tensorflow()
    from tfplan.profiler.static import profile_model
    from examples.gpt_megatron import gpt
    import keras
    before = keras.config.dtype_policy().name
    keras.config.set_dtype_policy("mixed_float16")  # built under the policy: exact bytes
    try:
        with tf.Graph().as_default():
            model = gpt(layers or int(row["layers"]), int(row["hidden"]), int(row["heads"]),
                        VOCAB, SEQ)
            return profile_model(model, 1, precision="mixed_float16", optimizer="adam",
                                 name="gpt", repeat_blocks=True)
    finally:
        keras.config.set_dtype_policy(before)


def evaluate(row: dict[str, float], profile, search_too: bool = True) -> dict:
    from tfplan.planner.search import search
    gpus, batch = int(row["gpus"]), int(row["batch"])
    cluster = cluster_for(gpus)
    flops = megatron_flops_per_iteration(batch, SEQ, int(row["layers"]), int(row["hidden"]),
                                         VOCAB)
    fixed = search(profile, cluster, batch, fix=published_strategy(row)).chosen
    tflops = flops / (fixed.predicted.step_time_s * gpus) / 1e12
    out = {"params_billion": row["params_billion"], "gpus": gpus, "plan": fixed,
           "predicted_tflops": tflops, "published_tflops": row["tflops_per_gpu"],
           "error": tflops / row["tflops_per_gpu"] - 1}
    if search_too:
        start = time.perf_counter()
        result = search(profile, cluster, batch)
        out["search_s"] = time.perf_counter() - start
        out["searched"] = result.chosen
        out["evaluated"] = result.evaluated
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="", help="comma-separated row indexes (default all)")
    parser.add_argument("--no-search", action="store_true")
    args = parser.parse_args(argv)
    table = read_table()
    picks = [int(i) for i in args.rows.split(",")] if args.rows else range(len(table))
    print(f"{'params':>8} {'gpus':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'pred TF/s':>9} "
          f"{'paper':>6} {'error':>7} {'fits':>5}  searched plan (pred TF/s, search s)")
    worst = 0.0
    for i in picks:
        row = table[i]
        t0 = time.perf_counter()
        profile = profile_row(row)
        r = evaluate(row, profile, search_too=not args.no_search)
        s = r["plan"].strategy
        line = (f"{row['params_billion']:>7.1f}B {r['gpus']:>5} {s.tp:>3} {s.pp:>3} {s.dp:>4} "
                f"{r['predicted_tflops']:>9.1f} {r['published_tflops']:>6.0f} "
                f"{100 * r['error']:>+6.1f}% {str(r['plan'].predicted.fits):>5}")
        if "searched" in r:
            ratio = r["plan"].predicted.step_time_s / r["searched"].predicted.step_time_s
            line += (f"  {r['searched'].name} ({r['predicted_tflops'] * ratio:.1f}, "
                     f"{r['search_s']:.1f} s, {r['evaluated']} priced)"
                     + ("" if ratio >= 1 - 1e-9 else "  SLOWER THAN PUBLISHED"))
        print(line + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        worst = max(worst, abs(r["error"]))
    print(f"worst |error| {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
