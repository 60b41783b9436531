"""Batch statistics in plans (``planner.batch_stats``): the rule each plan records, what
global statistics cost (all-reduces under dp, a barrier in pipelines), what ``plan
analyze`` says."""
from __future__ import annotations

import dataclasses

import pytest

from tfplan.core.errors import PlannerError
from tfplan.planner import collectives as coll
from tfplan.planner import cost_model as cm
from tfplan.planner.batch_stats import ALLREDUCES_PER_LAYER, STAT_BYTES, describe
from tfplan.planner.search import search
from tests.planner.test_search import chain_profile, make_cluster

CHANNELS = 64


def bn_profile(n_layers: int = 8):
    """The chain with every odd layer a BatchNormalization of CHANNELS channels."""
    p = chain_profile(n_layers)
    layers = tuple(dataclasses.replace(l, type="BatchNormalization", params=4 * CHANNELS,
                                       output_shape=(CHANNELS,)) if i % 2 else l
                   for i, l in enumerate(p.layers))
    return dataclasses.replace(p, layers=layers)


def test_every_plan_records_the_rule_and_models_without_bn_pay_nothing():
    for mode in ("global", "local"):
        result = search(chain_profile(), make_cluster(), 32, batch_norm=mode)
        assert {c.strategy.batch_norm for c in result.candidates} == {mode}
        assert describe(result.chosen, chain_profile()) is None
    plain = search(chain_profile(), make_cluster(), 32, fix={"dp": 4}).chosen
    local = search(chain_profile(), make_cluster(), 32, fix={"dp": 4}, batch_norm="local").chosen
    assert plain.predicted.step_time_s == local.predicted.step_time_s
    with pytest.raises(PlannerError, match="batch_norm is 'sync'"):
        search(chain_profile(), make_cluster(), 32, batch_norm="sync")


def test_global_statistics_under_dp_cost_their_all_reduces():
    profile, cluster = bn_profile(), make_cluster()
    glob = search(profile, cluster, 32, fix={"dp": 4}).chosen
    local = search(profile, cluster, 32, fix={"dp": 4}, batch_norm="local").chosen
    one = coll.group_allreduce_time_s(CHANNELS * STAT_BYTES, range(4), cluster)
    expected = 4 * ALLREDUCES_PER_LAYER * one  # 4 BatchNormalization layers
    assert glob.predicted.breakdown.communication_s - local.predicted.breakdown.communication_s \
        == pytest.approx(expected)
    assert glob.predicted.step_time_s == pytest.approx(glob.predicted.breakdown.total_s)
    said = describe(glob, profile)
    assert said["mode"] == "global" and said["equal_to_one_device"] and said["parts"] == 4
    assert said["sync_s"] == pytest.approx(expected)
    assert "20 small all-reduces" in said["text"]
    said = describe(local, profile)
    assert not said["equal_to_one_device"] and "differ from one device" in said["text"]


def test_global_statistics_make_a_pipeline_wait_for_every_microbatch():
    profile, cluster = bn_profile(), make_cluster()
    fix = {"pp": 2, "num_microbatches": 4}
    glob = search(profile, cluster, 32, fix=fix).chosen
    local = search(profile, cluster, 32, fix=fix, batch_norm="local").chosen
    assert glob.stages == local.stages  # same split: the barrier scales the bubble only
    assert glob.predicted.breakdown.bubble_s == pytest.approx(
        4 * local.predicted.breakdown.bubble_s)
    assert glob.predicted.breakdown.bubble_s == pytest.approx(
        cm.batch_barrier_bubble_s(2, local.predicted.breakdown.bubble_s, 4))
    assert describe(glob, profile)["pipeline_barrier"]
    assert "barrier" in describe(glob, profile)["text"]
    # a search offers such pipelines in GPipe order only; 1F1B asked for is refused
    result = search(profile, make_cluster(8), 64)
    for c in result.candidates:
        if c.strategy.pp > 1 and c.strategy.num_microbatches > 1:
            assert c.strategy.schedule == "gpipe", c.name
    with pytest.raises(PlannerError, match="1f1b cannot run with global batch statistics"):
        search(profile, cluster, 32, fix={"pp": 2, "schedule": "1f1b", "microbatch_size": 4})
    ok = search(profile, cluster, 32, fix={"pp": 2, "schedule": "1f1b", "microbatch_size": 4},
                batch_norm="local").chosen
    assert ok.strategy.schedule == "1f1b"
