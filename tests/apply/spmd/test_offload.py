"""Offload of the optimizer (ZeRO-Offload) on the SPMD engine: every optimizer slot on the
host CPU (each copy's, or under ZeRO each shard's), training equal to one device's, and
the copies to and from the host counted apart (kind ``host``) from the plan's sends; with
the weights offloaded too (``optimizer+weights``, without ZeRO and with ZeRO-1/2) every
copy's weights on the host, read by its layers on their device; under ZeRO-3 the shards
trained there, each layer's gather reading them."""
from __future__ import annotations

import dataclasses

import keras
import pytest

from tfplan.apply.audit import audit_step, compare
from tfplan.planner.traffic import plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tests.apply.spmd.test_engine import (BATCH, STEPS, _device, _wrapped,
                                          wrapped_and_reference)

HOST = ("CPU", 0)


@pytest.mark.parametrize("case, zero", [("dp2-m2", 0), ("dp2xtp2", 1)])
def test_the_optimizer_state_lives_on_the_host_and_training_is_one_devices(case, zero):
    module, _, wrapped, reference = _wrapped("tiny_mlp", case, zero=zero, offload="optimizer")
    opt = wrapped.optimizer
    slots = opt._momentums + opt._velocities
    assert slots and {_device(s.value.device) for s in slots} == {HOST}
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))


@pytest.mark.parametrize("offload, zero", [("optimizer", 0), ("optimizer+weights", 0),
                                          ("optimizer+weights", 1), ("optimizer+weights", 2),
                                          ("optimizer+weights", 3)])
def test_host_copies_are_counted_apart_from_the_plans_sends(offload, zero):
    if offload == "optimizer":
        module, plan, wrapped, _ = _wrapped("tiny_mlp", "dp4", offload=offload)
    else:  # devices apart from the host (CPU:0), whose weights every device reads
        module = helpers.load_model_file("tiny_mlp")
        keras.utils.set_random_seed(0)
        plan = helpers.tp_plan(module.build_model(), [helpers.cpus(1, 2, 3, 4)], dp=4,
                               global_batch=BATCH, zero=zero)
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                      offload=offload))
        wrapped, reference = wrapped_and_reference(module, plan)
        assert {_device(v.value.device) for m in wrapped.device_models
                for v in m.variables} == {HOST}  # every copy's weights on the host
        assert {_device(v.value.device) for v in wrapped.optimizer.variables} == {HOST}
        if zero == 3:  # the weights trained: the shards, on the host
            assert {_device(v.value.device) for v in wrapped._zero.variables} == {HOST}
        batches = helpers.batches_of(module, STEPS, BATCH)
        helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                    helpers.step_losses(reference, batches))
    x, y = module.sample_batch(BATCH)
    audit = audit_step(wrapped, x, y, plan=plan)
    keras.utils.set_random_seed(0)
    priced = plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH), plan)
    doc = compare(audit, priced, plan.devices)
    assert doc["within_tolerance"], doc
    by_device = audit.by_device()
    # gradients, updates (and the weights' reads when they live there)
    assert all(by_device[d]["host"] > 0 for d in plan.devices if _device(d) != HOST)
