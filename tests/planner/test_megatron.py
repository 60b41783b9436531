"""The what-if path against Megatron-LM's published throughput (SC'21, Table 1, row 1.7B).

A regression guard for the cost model: the full table is benchmarks/megatron_table1.py
(symbolic profiles of the real Keras GPTs); this uses the hand-made profile of the same
GPT (tests/planner/gpt_profile.py) so it runs without TensorFlow.
"""
from __future__ import annotations

import pytest

from benchmarks.megatron_table1 import (megatron_flops_per_iteration, published_strategy,
                                        read_table)
from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tests.planner.gpt_profile import gpt_profile


def _row(params_billion: float) -> dict:
    return next(r for r in read_table() if r["params_billion"] == params_billion)


@pytest.mark.parametrize("params_billion", [1.7, 7.5])
def test_published_strategy_is_predicted_within_15_percent(params_billion):
    row = _row(params_billion)
    profile = gpt_profile(int(row["layers"]), int(row["hidden"]), int(row["heads"]))
    gpus, batch = int(row["gpus"]), int(row["batch"])
    cluster = parse_cluster(f"{gpus // 8}x8xA100-80GB")
    plan = search(profile, cluster, batch, fix=published_strategy(row)).chosen
    s = plan.strategy
    assert (s.dp * s.tp * s.pp, s.recompute) == (gpus, "full")
    flops = megatron_flops_per_iteration(batch, 2048, int(row["layers"]), int(row["hidden"]),
                                         51200)
    tflops = flops / (plan.predicted.step_time_s * gpus) / 1e12
    assert tflops == pytest.approx(row["tflops_per_gpu"], rel=0.15)
    # Eq. 3 counts the recomputed forward: it is our hardware FLOP/s, up to Eq. 3's
    # approximations (it drops LayerNorm and residual FLOPs)
    assert plan.predicted.hardware_tflops_per_device == pytest.approx(tflops, rel=0.05)
    assert plan.predicted.model_tflops_per_device < plan.predicted.hardware_tflops_per_device
