"""planner.validate: searched plans pass; broken plans are refused with a clear message."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tfplan.core.errors import PlanMismatchError, SolverError
from tfplan.planner.plan import Stage
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tests.planner.test_search import MB, chain_profile, make_cluster

PROFILE = chain_profile()


@pytest.fixture(scope="module")
def pipeline_plan():
    plan = search(PROFILE, make_cluster(memory_bytes=100 * MB), 32, fix={"pp": 2}).chosen
    assert [len(s.layers) for s in plan.stages] == [4, 4]
    return plan


@pytest.fixture(scope="module")
def dp_plan():
    return search(PROFILE, make_cluster(), 32, fix={"dp": 4}).chosen


def test_searched_plans_pass(pipeline_plan, dp_plan):
    validate_plan(pipeline_plan, PROFILE)
    validate_plan(dp_plan, PROFILE)


def test_missing_layer(pipeline_plan):
    s0, s1 = pipeline_plan.stages
    broken = replace(pipeline_plan, stages=(s0, replace(s1, layers=s1.layers[:-1])))
    with pytest.raises(PlanMismatchError, match=r"'d7' are in no stage"):
        validate_plan(broken, PROFILE)


def test_layer_in_two_stages(pipeline_plan):
    s0, s1 = pipeline_plan.stages
    broken = replace(pipeline_plan, stages=(s0, replace(s1, layers=(s0.layers[-1], *s1.layers))))
    with pytest.raises(PlanMismatchError, match="in stage 0 and again in stage 1"):
        validate_plan(broken, PROFILE)


def test_non_contiguous_stage(pipeline_plan):
    s0, s1 = pipeline_plan.stages
    swapped = (replace(s0, layers=("d0", "d1", "d2", "d4")),
               replace(s1, layers=("d3", "d5", "d6", "d7")))
    with pytest.raises(PlanMismatchError, match="not contiguous"):
        validate_plan(replace(pipeline_plan, stages=swapped), PROFILE)


def test_duplicate_and_unknown_devices(pipeline_plan):
    s0, s1 = pipeline_plan.stages
    twice = (s0, replace(s1, devices=s0.devices))
    with pytest.raises(PlanMismatchError, match="used by stage 0 and again by stage 1"):
        validate_plan(replace(pipeline_plan, stages=twice), PROFILE)
    unknown = (s0, replace(s1, devices=("/device:GPU:9",)))
    with pytest.raises(PlanMismatchError, match="does not have"):
        validate_plan(replace(pipeline_plan, stages=unknown), PROFILE)


def test_stage_needs_dp_devices(dp_plan):
    (stage,) = dp_plan.stages
    short = replace(dp_plan, stages=(Stage(stage.layers, stage.devices[:3]),))
    with pytest.raises(PlanMismatchError, match="dp = 4"):
        validate_plan(short, PROFILE)


def test_strategy_numbers(dp_plan, pipeline_plan):
    with pytest.raises(PlanMismatchError, match="expected the global batch 32"):
        validate_plan(replace(dp_plan, strategy=replace(dp_plan.strategy, microbatch_size=4)),
                      PROFILE)
    with pytest.raises(PlanMismatchError, match="has 4"):
        validate_plan(replace(dp_plan, strategy=replace(dp_plan.strategy, dp=8,
                                                        microbatch_size=4)), PROFILE)
    with pytest.raises(PlanMismatchError, match="2 stages; expected pp = 3"):
        validate_plan(replace(pipeline_plan, strategy=replace(pipeline_plan.strategy, pp=3)),
                      PROFILE)


def test_other_model_and_error_type(dp_plan):
    other = chain_profile(n_layers=7)
    with pytest.raises(PlanMismatchError, match="Re-run `plan analyze`"):
        validate_plan(dp_plan, other)
    with pytest.raises(SolverError):
        validate_plan(dp_plan, other, error_type=SolverError)


def test_breakdown_must_sum_to_step_time(dp_plan):
    pred = replace(dp_plan.predicted, step_time_s=dp_plan.predicted.step_time_s * 2)
    with pytest.raises(PlanMismatchError, match="breakdown sums to"):
        validate_plan(replace(dp_plan, predicted=pred), PROFILE)


def _general(pipeline_plan, layers0, layers1, **strategy):
    s0, s1 = pipeline_plan.stages
    fields = dict(num_microbatches=1, microbatch_size=32) | strategy
    return replace(pipeline_plan, placement="general",
                   stages=(replace(s0, layers=layers0), replace(s1, layers=layers1)),
                   strategy=replace(pipeline_plan.strategy, **fields))


def test_general_placement_needs_no_contiguity_but_each_layer_once(pipeline_plan):
    layers0, layers1 = ("d0", "d2", "d4", "d6"), ("d1", "d3", "d5", "d7")
    general = _general(pipeline_plan, layers0, layers1)
    validate_plan(general, PROFILE)
    with pytest.raises(PlanMismatchError, match="not contiguous"):  # stages still must be
        validate_plan(replace(general, placement="stages"), PROFILE)
    with pytest.raises(PlanMismatchError, match="in stage 0 and again in stage 1"):
        validate_plan(_general(pipeline_plan, layers0, ("d0",) + layers1), PROFILE)
    with pytest.raises(PlanMismatchError, match="'d7' are in no stage"):
        validate_plan(_general(pipeline_plan, layers0, layers1[:-1]), PROFILE)
    s0, s1 = general.stages
    with pytest.raises(PlanMismatchError, match="used by stage 0 and again by stage 1"):
        validate_plan(replace(general, stages=(s0, replace(s1, devices=s0.devices))), PROFILE)
    with pytest.raises(PlanMismatchError, match="2 stages; expected pp = 3"):
        validate_plan(replace(general, strategy=replace(general.strategy, pp=3)), PROFILE)


def test_general_placement_runs_one_batch_on_one_device_per_stage(pipeline_plan):
    layers0, layers1 = ("d0", "d2", "d4", "d6"), ("d1", "d3", "d5", "d7")
    with pytest.raises(PlanMismatchError, match="num_microbatches = 2"):
        validate_plan(_general(pipeline_plan, layers0, layers1, num_microbatches=2,
                               microbatch_size=16), PROFILE)
    with pytest.raises(PlanMismatchError, match="placement is 'anywhere'"):
        validate_plan(replace(_general(pipeline_plan, layers0, layers1),
                              placement="anywhere"), PROFILE)
