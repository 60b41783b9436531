"""ZeRO-1 and ZeRO-2 (apply.zero): plans with ``optimizer_sharding`` keep each weight's
optimizer slots on one replica, the owner ``planner.zero`` names, and train exactly like
one device; ZeRO-2 (``zero_stage=2``) also accumulates each weight's gradient on its owner
only.

Runs on the logical CPU devices of tests/conftest.py with hand-made plans: the tiny MLP
with dp = 2 and dp = 4, the tiny transformer with dp = 2, a hybrid dp = 2 x pp = 2 (two
micro-batches) and dp = 2 x tp = 2; ZeRO-2 with dp = 4 on the MLP and the transformer,
with one and two micro-batches.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from collections import defaultdict

import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.device_names import short_name
from tfplan.apply.placement import tf_variable
from tfplan.apply.tensor_parallel import TensorParallelModel
from tfplan.apply.dimensions import unapplied
from tfplan.apply.mode import execution_mode
from tfplan.apply.zero import weight_groups
from tfplan.planner.zero import owners_by_device_group
from tests.apply import helpers  # noqa: E402
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, step_losses, tp_plan)

STEPS = 10
MLP_SPLITS = (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
              ("head", "row"))

# name: (model file, devices of each stage (dp x tp per stage), micro-batches, dp, splits,
#        ZeRO stage)
CASES = {
    "mlp-dp2": ("tiny_mlp", [cpus(0, 1)], 1, 2, (), 1),
    "mlp-dp4": ("tiny_mlp", [cpus(0, 1, 2, 3)], 1, 4, (), 1),
    "transformer-dp2": ("tiny_transformer", [cpus(2, 3)], 1, 2, (), 1),
    "mlp-dp2-pp2-m2": ("tiny_mlp", [cpus(0, 1), cpus(2, 3)], 2, 2, (), 1),
    "mlp-dp2-tp2": ("tiny_mlp", [cpus(4, 5, 6, 7)], 1, 2, MLP_SPLITS, 1),
    "zero2-mlp-dp4": ("tiny_mlp", [cpus(0, 1, 2, 3)], 1, 4, (), 2),
    "zero2-mlp-dp4-m2": ("tiny_mlp", [cpus(4, 5, 6, 7)], 2, 4, (), 2),
    "zero2-transformer-dp4": ("tiny_transformer", [cpus(0, 1, 2, 3)], 1, 4, (), 2),
    "zero2-transformer-dp4-m2": ("tiny_transformer", [cpus(4, 5, 6, 7)], 2, 4, (), 2),
}


def zero_plan(model, stage_devices, *, num_microbatches=1, dp, splits=(), stage=1):
    """A hand-made plan (tests/apply/helpers.tp_plan) with ZeRO stage ``stage`` on."""
    plan = tp_plan(model, stage_devices, splits, dp=dp, zero=True,
                   num_microbatches=num_microbatches, global_batch=GLOBAL_BATCH,
                   name=f"zero{stage} dp={dp} tp={len(stage_devices[0]) // dp} "
                        f"pp={len(stage_devices)}")
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  zero_stage=stage))


def reference_losses(name: str) -> list[float]:
    """Single-device losses of STEPS steps from the same weights and batches."""
    return helpers.reference_losses(name, STEPS)


def _device(variable) -> str:
    return short_name(tf_variable(variable).device)


def _nbytes(variable) -> int:
    return int(np.prod(variable.shape, dtype=np.int64)) * tf.as_dtype(variable.dtype).size


# zero2-transformer-dp4: ZeRO-2 runs by default on the transformer with dp = 4 and 2
# micro-batches, with one micro-batch on the MLP
SLOW = {"zero2-transformer-dp4"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_sharded_optimizer_trains_like_one_device(case, recwarn):
    name, devices, m, dp, splits, stage = CASES[case]
    module, model = base_model(name)
    plan = zero_plan(model, devices, num_microbatches=m, dp=dp, splits=splits, stage=stage)
    assert execution_mode(plan).mode == "tensor_parallel"
    wrapped = apply.wrap(model, plan)
    assert not [w for w in recwarn.list if "optimizer_sharding" in str(w.message)
                or "ZeRO" in str(w.message)]  # applied, so no "not applied yet" warning
    assert isinstance(wrapped, TensorParallelModel) and wrapped.optimizer_sharding
    assert wrapped.zero_stage == stage
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)),
                        reference_losses(name))
    optimizer = wrapped.optimizer
    assert int(optimizer.iterations.numpy()) == STEPS  # one update per step

    # the owners planner.zero names, from the copies' devices and sizes alone
    variables = list(wrapped.trainable_variables)
    n = len(variables) // dp
    copies = [[variables[r * n + i] for r in range(dp)] for i in range(n)]
    groups = [(tuple(_device(v) for v in c), _nbytes(c[0])) for c in copies]
    owners = owners_by_device_group(groups)
    assert [g.owner for g in weight_groups(variables, dp)] == owners
    # each weight's dp copies are on dp different devices (of its stage and tp rank)
    assert all(len(set(devices_)) == dp for devices_, _ in groups)

    # slots: on the owners' copies only, each on its owner's device
    built = {id(v) for v in optimizer._trainable_variables}
    assert built == {id(c[o]) for c, o in zip(copies, owners)} and len(built) == n
    slot_bytes: dict[str, int] = defaultdict(int)
    for c, o, (devices_, size) in zip(copies, owners, groups):
        for r, copy in enumerate(c):
            if r != o:
                assert optimizer._var_key(copy) not in optimizer._trainable_variables_indices
        index = optimizer._get_variable_index(c[o])
        for slots in (optimizer._momentums, optimizer._velocities):
            assert _device(slots[index]) == devices_[o], (c[o].path, _device(slots[index]))
            assert tuple(slots[index].shape) == tuple(c[o].shape)
            slot_bytes[devices_[o]] += _nbytes(slots[index])
    assert len(optimizer._momentums) == len(optimizer._velocities) == n
    # Adam holds 2 slots per weight, once (not dp times)
    assert sum(slot_bytes.values()) == 2 * sum(size for _, size in groups)
    # balanced within each set of dp devices: at most the largest variable's slots apart
    for devices_ in {d for d, _ in groups}:
        loads = [slot_bytes.get(d, 0) for d in devices_]
        largest = max(2 * size for d, size in groups if d == devices_)
        assert max(loads) - min(loads) <= largest, (devices_, loads)
    if dp == 2 and len({d for d, _ in groups}) == 1:
        assert len(slot_bytes) == 2  # every replica owns some state

    # after training, every copy of every weight is the owner's, exactly
    for c in copies:
        first = c[0].numpy()
        for copy in c[1:]:
            np.testing.assert_array_equal(copy.numpy(), first)


def test_the_train_step_reduces_on_the_owner_only():
    """Each weight's gradient sum (one AddN over the dp replicas) runs once, on its
    owner's device: a reduce; without sharding the same model sums on every copy."""
    module, model = base_model("tiny_mlp")
    x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
    counts = {}
    for sharded in (True, False):
        wrapped = apply.wrap(model, zero_plan(model, [cpus(0, 1)], dp=2))
        wrapped.optimizer_sharding = sharded  # False: the all-reduce of apply.tensor_parallel
        wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        step = tf.function(lambda data, model=wrapped: model.train_step(data),
                           autograph=False)  # as Keras traces it
        graph = step.get_concrete_function((tf.constant(x), tf.constant(y))).graph
        sums = [op for op in graph.get_operations()
                if op.type == "AddN" and op.name.split("/")[0].startswith("AddN")]
        counts[sharded] = collections.Counter(short_name(op.device) for op in sums)
        if sharded:
            groups = weight_groups(wrapped.trainable_variables, 2)
            assert counts[sharded] == collections.Counter(g.owner_device for g in groups)
            assert len(wrapped.optimizer._momentums) == len(groups)
    n = len(model.trainable_variables)
    assert sum(counts[True].values()) == n
    assert counts[False] == {"/device:CPU:0": n, "/device:CPU:1": n}


def _step_graph(wrapped, x, y):
    step = tf.function(lambda data, model=wrapped: model.train_step(data),
                       autograph=False)  # as Keras traces it
    return step.get_concrete_function((tf.constant(x), tf.constant(y))).graph


def test_zero2_accumulates_each_gradient_on_its_owner_only():
    """With two micro-batches, ZeRO-1 accumulates every replica's full gradient on that
    replica's devices and reduces once; ZeRO-2 reduces each micro-batch's gradients on the
    owner's device (one AddN per weight per micro-batch) and accumulates there alone."""
    module, model = base_model("tiny_mlp")
    x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
    n, m, dp = len(model.trainable_variables), 2, 2
    found = {}
    for stage in (1, 2):
        wrapped = apply.wrap(model, zero_plan(model, [cpus(0, 1)], dp=dp, stage=stage,
                                              num_microbatches=m))
        wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        graph = _step_graph(wrapped, x, y)
        ops = graph.get_operations()
        reduces = collections.Counter(short_name(op.device) for op in ops
                                      if op.type == "AddN" and op.name.startswith("AddN"))
        # PlannedModel's accumulation: a top-level add per weight (copy) and micro-batch
        adds = collections.Counter(short_name(op.device) for op in ops if op.type == "AddV2"
                                   and re.fullmatch(r"add(_\d+)?", op.name))
        owners = collections.Counter(g.owner_device
                                     for g in weight_groups(wrapped.trainable_variables, dp))
        found[stage] = (reduces, adds, owners)
    reduces, adds, owners = found[1]
    assert reduces == owners  # one reduce per weight, after accumulating
    assert adds == {"/device:CPU:0": n * (m - 1), "/device:CPU:1": n * (m - 1)}  # every copy
    reduces, adds, owners = found[2]
    assert reduces == {d: m * k for d, k in owners.items()}  # per micro-batch, on the owner
    assert adds == {d: (m - 1) * k for d, k in owners.items()}  # the owner's sums only
    assert sum(adds.values()) == n * (m - 1)


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
