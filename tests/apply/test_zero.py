"""ZeRO-1 and ZeRO-2 across workers (apply.zero, apply.zero_workers): plans with
``optimizer_sharding`` keep each weight's optimizer slots on one replica, the owner
``planner.zero`` names; ZeRO-2 (``zero_stage=2``) also keeps each reduced gradient on its
owner only.

On one host, ZeRO-1/2 run on the SPMD engine (apply.spmd.zero: every device holds 1/dp of
each weight's state, reduce-scatter and all-gather), tested in tests/apply/spmd/test_zero.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfplan.apply.device_names import short_name
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


def test_zero2_and_3_run_on_one_host_per_worker_and_through_worker_0():
    """ZeRO-2 runs on one host, with one program per worker (apply.zero_workers:
    tests/apply/test_zero_workers.py) and with a replica spanning workers (apply.remote:
    tests/apply/test_zero_remote.py); ZeRO-3 on one host and through worker 0, while
    per worker apply.wrap refuses it (tests/apply/test_zero3.py)."""
    from tfplan.core.presets import parse_cluster

    _, model = base_model("tiny_mlp")
    one_host = zero_plan(model, [cpus(0, 1)], dp=2, stage=2)
    assert unapplied(one_host, execution_mode(one_host)) == []
    workers = dataclasses.replace(
        zero_plan(model, [[f"/job:worker/task:{w}/device:CPU:0" for w in range(2)]], dp=2,
                  stage=2), cluster=parse_cluster("2xcpu:1"))
    assert execution_mode(workers).mode == "multi_worker_hybrid"
    assert unapplied(workers, execution_mode(workers)) == []
    for stage in (2, 3):
        spanning = dataclasses.replace(  # replica r's pipeline over both workers
            zero_plan(model, [[f"/job:worker/task:{w}/device:CPU:{r}" for r in range(2)]
                              for w in range(2)], dp=2, stage=stage, num_microbatches=2),
            cluster=parse_cluster("2xcpu:2"))
        assert execution_mode(spanning).remote
        assert unapplied(spanning, execution_mode(spanning)) == []


def test_zero2_across_workers_keeps_each_reduced_gradient_on_its_owner_only():
    """apply.zero_workers.reduce_to_owner_workers (one micro-batch's gradients, after the
    all-reduce; a one-replica context here): worker w keeps the sums of the weights it
    owns, at the owner copy's position and on its device, and nothing else."""
    from tfplan.apply.zero_workers import job_weights, reduce_to_owner_workers

    variables = [tf.Variable(tf.fill(shape, float(i)), name=f"w{i}")
                 for i, shape in enumerate([(4, 3), (3,), (5, 2), (2,), (6,)])]
    copies = []
    for r in range(2):  # two local replicas, on CPU:r
        with tf.device(f"/device:CPU:{r}"):
            copies += [tf.Variable(v) for v in variables]
    weights = job_weights(copies, 2, 2)
    grads = [tf.ones_like(v) * (1 + k) for k, v in enumerate(copies)]
    n = len(variables)
    kept = {}
    for task in range(2):
        out = reduce_to_owner_workers(grads, weights, task)
        for w in weights:
            mine = w.owner_worker == task
            for r in range(2):
                g = out[r * n + w.index]
                assert (g is not None) == (mine and r == w.owner_replica), (task, w.index, r)
            if mine:
                g = out[w.owner_replica * n + w.index]
                assert short_name(g.device) == short_name(w.owner_copy.device)
                np.testing.assert_array_equal(g.numpy(), grads[w.index] + grads[n + w.index])
                kept[w.index] = task
    assert sorted(kept) == list(range(n)) and set(kept.values()) == {0, 1}
