"""planner.candidates, planner.pricing, planner.partition: the hybrid strategy space, its
prices and its invariants."""
from __future__ import annotations

import itertools
import random

import pytest

from tfplan.planner.search import search
from tfplan.planner.partition import min_max_partition
from tfplan.planner.tp_splits import tp_split_rule
from tfplan.planner.validate import validate_plan
from tests.planner.gpt_profile import gpt_profile
from tests.planner.test_search import MB, chain_profile, make_cluster


def _brute_min_max(weights, parts):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = list(zip((0,) + cuts, cuts + (n,)))
        worst = max(sum(weights[a:b]) for a, b in bounds)
        best = worst if best is None else min(best, worst)
    return best


def test_min_max_partition_equals_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        weights = tuple(rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n))
        parts = rng.randint(1, n)
        bounds = min_max_partition(weights, parts)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a < b for a, b in bounds) and all(
            x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
        worst = max(sum(weights[a:b]) for a, b in bounds)
        assert worst == pytest.approx(_brute_min_max(weights, parts), rel=1e-6, abs=1e-9)


def test_tp_split_rule_alternates_dense_pairs():
    types = ("Embedding", "LayerNormalization", "MultiHeadAttention", "Add", "Dense", "Dense",
             "Add", "Dense")
    assert tp_split_rule(types) == ("vocab", "", "heads", "", "column", "row", "", "column")


def _fixed(profile, cluster, batch, **fix):
    return search(profile, cluster, batch, fix=fix).chosen


def test_tensor_parallel_divides_state_and_compute_and_adds_allreduces():
    profile = gpt_profile(2, 1024, 16, vocab=8192, seq=512)
    from tfplan.core.presets import parse_cluster
    cluster = parse_cluster("8xA100-80GB")
    one = _fixed(profile, cluster, 8, dp=1, tp=1, pp=1, recompute="none")
    two = _fixed(profile, cluster, 8, dp=1, tp=2, pp=1, recompute="none")
    assert two.predicted.max_memory_bytes < 0.6 * one.predicted.max_memory_bytes
    assert two.predicted.breakdown.compute_s < 0.55 * one.predicted.breakdown.compute_s
    assert two.predicted.breakdown.communication_s > 0 == one.predicted.breakdown.communication_s
    assert len(two.stages[0].devices) == 2
    validate_plan(two, profile)


def test_savers_trade_memory_for_time():
    profile = gpt_profile(4, 1024, 16, vocab=8192, seq=512)
    from tfplan.core.presets import parse_cluster
    cluster = parse_cluster("8xA100-80GB")
    base = dict(dp=2, tp=1, pp=2, microbatch_size=1)  # unnamed knobs would be searched
    no_zero = dict(zero_stage=0)
    gpipe = _fixed(profile, cluster, 32, **base, schedule="gpipe", recompute="none", **no_zero)
    f1b = _fixed(profile, cluster, 32, **base, schedule="1f1b", recompute="none", **no_zero)
    # all 16 micro-batches in flight (GPipe): what recomputation saves shows most
    full = _fixed(profile, cluster, 32, **base, schedule="gpipe", recompute="full", **no_zero)
    sel = _fixed(profile, cluster, 32, **base, schedule="gpipe", recompute="selective",
                 **no_zero)
    zero = _fixed(profile, cluster, 32, **base, schedule="1f1b", recompute="none",
                  zero_stage=1)
    assert f1b.predicted.step_time_s == pytest.approx(gpipe.predicted.step_time_s)
    assert f1b.predicted.max_memory_bytes < gpipe.predicted.max_memory_bytes
    assert full.predicted.max_memory_bytes < sel.predicted.max_memory_bytes \
        < gpipe.predicted.max_memory_bytes
    assert full.predicted.breakdown.recompute_s > sel.predicted.breakdown.recompute_s > 0
    assert full.predicted.hardware_tflops_per_device > full.predicted.model_tflops_per_device
    assert f1b.predicted.hardware_tflops_per_device == pytest.approx(
        f1b.predicted.model_tflops_per_device)
    assert zero.predicted.max_memory_bytes < f1b.predicted.max_memory_bytes
    for plan in (gpipe, f1b, full, sel, zero):
        validate_plan(plan, profile)
        assert plan.strategy.num_microbatches == 16


def test_fixed_hybrid_that_does_not_fit_is_returned_with_fits_false():
    profile = chain_profile()
    plan = _fixed(profile, make_cluster(memory_bytes=30 * MB), 32, dp=2, tp=1, pp=2)
    assert not plan.predicted.fits and "does NOT fit" in plan.reason
    assert plan.predicted.headroom_bytes < 0
    assert plan.to_dict()["predicted"]["fits"] is False


def test_every_candidate_validates_and_search_is_deterministic():
    profile = gpt_profile(1, 1024, 16, vocab=8192, seq=512)
    from tfplan.core.presets import parse_cluster
    cluster = parse_cluster("2x8xA100-80GB")
    a = search(profile, cluster, 64)
    assert a == search(profile, cluster, 64)
    assert a.evaluated > len(a.candidates)
    assert len([p for p in a.candidates if p.predicted.fits]) <= 20
    for plan in a.candidates:
        validate_plan(plan, profile)
    assert "priced" in a.chosen.reason


def test_even_partition_balances_runs_and_covers_every_item():
    from tfplan.planner.partition import even_partition
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(2, 30)
        weights = tuple(rng.uniform(0.5, 1.5) for _ in range(n))
        parts = rng.randint(1, n)
        bounds = even_partition(weights, parts)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a < b for a, b in bounds)
        assert all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
        # each run within one item of the ideal share (cuts at the nearest prefix)
        ideal = sum(weights) / parts
        for a, b in bounds:
            assert abs(sum(weights[a:b]) - ideal) <= 2 * max(weights) + 1e-9


def _fixed_gpt(fix, layers=8):
    from tfplan.core.presets import parse_cluster
    profile = gpt_profile(layers, 1024, 16, vocab=8192, seq=512)
    return profile, search(profile, parse_cluster("8xA100-80GB"), 32, fix=fix).chosen


def test_interleaved_schedule_shrinks_the_bubble_and_places_chunks_round_robin():
    fix = {"dp": 1, "tp": 1, "pp": 4, "microbatch_size": 1}
    profile, plain = _fixed_gpt({**fix, "schedule": "1f1b"})
    _, inter = _fixed_gpt({**fix, "schedule": "interleaved", "virtual_stages": 2})
    s = inter.strategy
    assert (s.schedule, s.virtual_stages, s.num_microbatches) == ("interleaved", 2, 32)
    assert len(inter.stages) == 8 and len(plain.stages) == 4
    for k, stage in enumerate(inter.stages):
        assert stage.devices == inter.stages[k % 4].devices
    assert len(inter.devices) == 4  # each device once
    validate_plan(inter, profile)
    # (p-1)/v slots of the slowest device instead of p-1: about half the bubble
    assert inter.predicted.breakdown.bubble_s < 0.6 * plain.predicted.breakdown.bubble_s
    # more micro-batches' activations held during the longer warm-up
    assert inter.predicted.max_memory_bytes > plain.predicted.max_memory_bytes


def test_interleaving_needs_microbatches_in_multiples_of_the_stages():
    from tfplan.core.errors import PlannerError
    with pytest.raises(PlannerError, match="no strategy"):
        _fixed_gpt({"dp": 1, "pp": 3, "num_microbatches": 4, "schedule": "interleaved"})


def test_gradient_accumulation_trades_time_for_activation_memory():
    profile, whole = _fixed_gpt({"dp": 2, "recompute": "none", "microbatch_size": 16})
    _, accumulated = _fixed_gpt({"dp": 2, "recompute": "none", "microbatch_size": 2})
    assert (whole.strategy.num_microbatches, accumulated.strategy.num_microbatches) == (1, 8)
    assert accumulated.predicted.max_memory_bytes < 0.5 * whole.predicted.max_memory_bytes
    assert accumulated.predicted.step_time_s > whole.predicted.step_time_s  # 8 passes
    validate_plan(accumulated, profile)
