"""Hybrid data x pipeline parallel on one host: dp replicas of a pipeline, each stage of
replica r on its own device, gradients summed across the replicas (apply.tensor_parallel
with tp = 1); losses equal single-device training."""
from __future__ import annotations

import pytest

from tfplan import apply
from tfplan.apply.mode import execution_mode
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, assert_losses_match, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan,
                                 reference_losses, step_losses)


@pytest.mark.parametrize("name,microbatches", [
    ("tiny_mlp", 1),
    # the same plans (dp2 x pp2 on CPUs 0-3, 2 micro-batches) run by default in
    # test_acceptance.py's matrix, with its placement checks: -m slow here
    pytest.param("tiny_mlp", 2, marks=pytest.mark.slow),
    pytest.param("tiny_transformer", 2, marks=pytest.mark.slow)])
def test_dp2_pp2_trains_like_one_device(name, microbatches):
    module, model = base_model(name)
    plan = make_plan(model, [cpus(0, 1), cpus(2, 3)], num_microbatches=microbatches)
    assert (plan.strategy.dp, plan.strategy.pp) == (2, 2)
    assert execution_mode(plan).mode == "tensor_parallel"
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)),
                        reference_losses(name))
    # replica r's copy of each stage's layers lives on that stage's device r
    from tfplan.apply.placement import tf_variable
    used = {tf_variable(v).device.split("device:")[-1] for v in wrapped.trainable_variables}
    assert used == {"CPU:0", "CPU:1", "CPU:2", "CPU:3"}
    # every copy of a stage-0 layer is on a stage-0 device, of a stage-1 layer on stage 1
    stage_devices = [{d.split("device:")[-1] for d in st.devices} for st in plan.stages]
    first, last = plan.stages[0].layers[0], plan.stages[-1].layers[-1]
    for v in wrapped.trainable_variables:
        device = tf_variable(v).device.split("device:")[-1]
        if v.path.startswith(first + "/"):
            assert device in stage_devices[0], v.path
        if v.path.startswith(last + "/"):
            assert device in stage_devices[-1], v.path
