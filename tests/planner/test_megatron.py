"""The what-if path against Megatron-LM's published throughput (SC'21, Table 1).

A regression guard for the cost model: the full table is benchmarks/megatron_table1.py
(symbolic profiles of the real Keras GPTs; every row is priced from the profiler's
output in tests/profiler/test_megatron_profiles.py); this uses the hand-made profile of
the same GPT (tests/planner/gpt_profile.py) so it runs without TensorFlow.
"""
from __future__ import annotations

import os

import pytest

from benchmarks.megatron_table1 import (ROOT, SETTINGS, TABLE, cluster_for,
                                        megatron_flops_per_iteration, published_strategy,
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


def test_reference_data_lives_in_the_repository():
    for path in (TABLE, SETTINGS):
        assert os.path.commonpath([path, ROOT]) == ROOT and os.path.isfile(path)
    rows = read_table()
    assert [r["params_billion"] for r in rows][:2] == [1.7, 3.6] and len(rows) == 10
    # the authors' script: micro-batch 16 on the small rows, 1 on the deepest pipelines;
    # interleaved where it sets layers per virtual stage (76B: 60 / 4 / 5 = 3 chunks)
    assert [int(r["micro_batch_size"]) for r in rows] == [16, 16, 16, 8, 4, 2, 2, 1, 1, 1]
    assert [int(r["chunks"]) for r in rows] == [1, 1, 1, 1, 1, 3, 2, 2, 3, 1]


@pytest.mark.parametrize("index", range(10))
def test_published_settings_fix_one_strategy(index):
    """Every choice the paper made is fixed, so ``search`` prices exactly one strategy:
    no optimizer sharding (Megatron-LM had none in 2021), the script's micro-batch size on
    every row, and its schedule and chunks where pp > 1."""
    row = read_table()[index]
    fix = published_strategy(row)
    assert fix["zero_stage"] == 0 and not fix["sequence_parallel"] and fix["recompute"] == "full"
    profile = gpt_profile(int(row["layers"]), int(row["hidden"]), int(row["heads"]))
    result = search(profile, cluster_for(int(row["gpus"])), int(row["batch"]), fix=fix)
    s = result.chosen.strategy
    assert result.evaluated == 1
    assert (s.microbatch_size, s.optimizer_sharding, s.layout) == (
        int(row["micro_batch_size"]), False, "tp-dp-pp")
    assert s.num_microbatches * s.microbatch_size * s.dp == int(row["batch"])
    if s.pp == 1:
        assert s.schedule == "none"
    else:
        assert (s.schedule, s.virtual_stages) == (
            ("interleaved", int(row["chunks"])) if row["chunks"] > 1 else ("1f1b", 1))


def test_model_flops_drop_only_the_recomputed_forward():
    b, s, l, h, v = 512, 2048, 24, 2304, 51200
    with_recompute = megatron_flops_per_iteration(b, s, l, h, v)
    without = megatron_flops_per_iteration(b, s, l, h, v, recompute=False)
    layer_forward = 24 * b * s * h**2 + 4 * b * s**2 * h  # one layer's forward
    logits_forward = 2 * b * s * h * v
    assert with_recompute == pytest.approx(4 * l * layer_forward + 3 * logits_forward)
    assert without == pytest.approx(3 * l * layer_forward + 3 * logits_forward)
    assert with_recompute - without == pytest.approx(l * layer_forward)
