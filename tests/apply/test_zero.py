"""ZeRO-1 and ZeRO-2 (apply.zero): plans with
``optimizer_sharding`` keep each weight's optimizer slots on one replica, the owner
``planner.zero`` names; ZeRO-2 (``zero_stage=2``) also keeps each reduced gradient on its
owner only.

On one host, ZeRO-1/2 run on the SPMD engine (apply.spmd.zero: every device holds 1/dp of
each weight's state, reduce-scatter and all-gather), tested in tests/apply/spmd/test_zero.py.
"""
from __future__ import annotations

import dataclasses


from tfplan.apply.dimensions import unapplied
from tfplan.apply.mode import execution_mode
from tests.apply.helpers import GLOBAL_BATCH, base_model, cpus, tp_plan

MLP_SPLITS = (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
              ("head", "row"))

def zero_plan(model, stage_devices, *, num_microbatches=1, dp, splits=(), stage=1):
    """A hand-made plan (tests/apply/helpers.tp_plan) with ZeRO stage ``stage`` on."""
    plan = tp_plan(model, stage_devices, splits, dp=dp, zero=True,
                   num_microbatches=num_microbatches, global_batch=GLOBAL_BATCH,
                   name=f"zero{stage} dp={dp} tp={len(stage_devices[0]) // dp} "
                        f"pp={len(stage_devices)}")
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  zero_stage=stage))


def test_zero2_and_3_run_on_one_host_and_one_program_per_worker():
    """ZeRO-2 and ZeRO-3 run on one host and with one program per worker (apply.spmd:
    tests/apply/test_workers.py), a replica's pipeline stages on several workers too."""
    from tfplan.core.presets import parse_cluster

    _, model = base_model("tiny_mlp")
    one_host = zero_plan(model, [cpus(0, 1)], dp=2, stage=2)
    assert unapplied(one_host, execution_mode(one_host)) == []
    workers = dataclasses.replace(
        zero_plan(model, [[f"/job:worker/task:{w}/device:CPU:0" for w in range(2)]], dp=2,
                  stage=2), cluster=parse_cluster("2xcpu:1"))
    assert execution_mode(workers).mode == "tensor_parallel"
    assert unapplied(workers, execution_mode(workers)) == []
    for stage in (2, 3):
        spanning = dataclasses.replace(  # replica r's pipeline over both workers
            zero_plan(model, [[f"/job:worker/task:{w}/device:CPU:{r}" for r in range(2)]
                              for w in range(2)], dp=2, stage=stage, num_microbatches=2),
            cluster=parse_cluster("2xcpu:2"))
        assert execution_mode(spanning).processes == "per_worker"
        assert unapplied(spanning, execution_mode(spanning)) == []


