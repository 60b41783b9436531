"""Offload (apply.offload): plans with ``offload="optimizer"`` keep every optimizer slot
and the update math on the host device, ``"optimizer+weights"`` the weights too, and both
train exactly like one device.

On the logical CPUs of tests/conftest.py the plan's devices are CPU:1..CPU:n and the host
is CPU:0. Every case runs on the SPMD engine (apply.spmd: each device's copy, its weights on
the host under ``optimizer+weights``) but ZeRO-1 with the weights offloaded (the older
engine). Asserted for one device, pp = 2 (two micro-batches), dp = 2 (the replicas as
copies, apply.tensor_parallel) and dp = 2 with ZeRO-1 (the owners' slots offloaded):
10 steps equal to one device (1e-4), every slot on CPU:0, every weight on its planned
device (or CPU:0 with the weights offloaded, its forward ops still on the planned
device), and in the traced train step every op of the optimizer's update math on CPU:0,
each gradient copied there, each write to a weight on the weight's device; tp = 2 keeps
its shards on their ranks; offloaded models compile without XLA. Plans offload cannot
run are refused by apply.wrap.
"""
from __future__ import annotations

import dataclasses

import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.device_names import short_name
from tfplan.apply.dimensions import unapplied
from tfplan.apply.mode import execution_mode
from tfplan.apply.offload import host_device
from tfplan.apply.placement import HOST_SCOPE, tf_variable
from tfplan.core.errors import PlanMismatchError
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, make_plan, step_losses, tp_plan)

STEPS = 10
HOST = "/device:CPU:0"
WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
NOT_MATH = ("Identity", "IdentityN", "Placeholder", "ReadVariableOp", "NoOp", "Const",
            *WRITES)


def offloaded(plan, offload="optimizer"):
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  offload=offload))


def plans(model):
    return {
        "single_device": make_plan(model, [cpus(1)]),
        "pp2": make_plan(model, [cpus(1), cpus(2)], num_microbatches=2),
        "dp2": make_plan(model, [cpus(1, 2)]),
        "dp2-zero1": tp_plan(model, [cpus(1, 2)], dp=2, zero=True),
    }


def _device(variable) -> str:
    return short_name(tf_variable(variable).device)


def planned_devices(plan, wrapped):
    """{id(variable): planned device} for every weight of every data-parallel copy."""
    stage_of = {name.split("/", 1)[0]: s for s, stage in enumerate(plan.stages)
                for name in stage.layers}
    out = {}
    for r, copy in enumerate(_copies(wrapped)):
        for layer in copy.layers:
            for v in layer.weights:
                out[id(v)] = plan.stages[stage_of[layer.name]].devices[r]
    return out


def _copies(wrapped):
    """Each data-parallel replica's model: the SPMD engine's device copies (tp = 1), or an
    older engine's replicas."""
    copies = getattr(wrapped, "device_models", None)
    return copies if copies is not None else wrapped.replica_models()


def slots(optimizer):
    """The optimizer's slots (its variables but the step count and learning rate)."""
    return [v for v in optimizer.variables
            if v is not optimizer.iterations and "learning_rate" not in v.path]


def train_step_graph(wrapped, x, y):
    spec = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    return tf.function(wrapped.train_step).get_concrete_function(spec).graph


def update_ops(wrapped, graph):
    """The ops the optimizer's update creates in the traced train step."""
    scope = wrapped.optimizer.name + "/"
    return [op for op in graph.get_operations() if op.name.startswith(scope)]


@pytest.mark.parametrize("case, offload", [
    (case, offload) for offload in ("optimizer", "optimizer+weights")
    # ZeRO-1/2 with the optimizer (and the weights) offloaded: every weight's shards on the
    # host, tests/apply/spmd/test_offload.py
    for case in ("single_device", "pp2", "dp2")])
def test_offloaded_state_trains_like_one_device_on_the_host(case, offload):
    module, model = base_model("tiny_mlp")
    plan = offloaded(plans(model)[case], offload)
    wrapped = apply.wrap(model, plan)
    assert type(wrapped).__name__ == "SpmdModel"  # the SPMD engine (apply.spmd)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    assert_losses_match(step_losses(wrapped, batches),
                        helpers.reference_losses("tiny_mlp", STEPS))

    # every weight where the plan puts it (the host, with the weights offloaded), every
    # slot on the host
    planned = planned_devices(plan, wrapped)
    assert HOST not in set(planned.values())
    weights_on_host = offload == "optimizer+weights"
    if weights_on_host:
        planned = {k: HOST for k in planned}
    weights = [v for copy in _copies(wrapped) for v in copy.weights]
    assert weights and {id(v) for v in weights} == set(planned)
    assert [(v.path, _device(v)) for v in weights] == [(v.path, planned[id(v)])
                                                       for v in weights]
    optimizer_slots = slots(wrapped.optimizer)
    trained = wrapped.trainable_variables
    per_weight = 2  # Adam: momentum and velocity
    owners = len(trained)
    assert len(optimizer_slots) == per_weight * owners
    assert {_device(v) for v in optimizer_slots} == {HOST}

    # the update math on the host, each gradient copied there (it is there already when
    # the weights are), each weight written on its own device
    x, y = batches[0]
    graph = train_step_graph(wrapped, x, y)
    ops = update_ops(wrapped, graph)
    math = [op for op in ops if op.type not in NOT_MATH]
    assert len(math) >= 5 * owners, [op.type for op in math]
    assert {short_name(op.device) for op in math} == {HOST}, sorted(
        {(op.type, op.device) for op in math})
    # (the copy: an Identity on the weight's device under apply.placement.HOST_SCOPE, which
    # the host's update reads: the audit counts what it sends as a host transfer)
    copies = [op for op in ops if op.type == "Identity" and HOST_SCOPE in op.name
              and short_name(op.device or HOST) != HOST
              and {short_name(c.device) for t in op.outputs for c in t.consumers()} == {HOST}]
    assert len(copies) == (0 if weights_on_host else owners)
    weight_devices = {short_name(tf_variable(v).device) for v in trained}
    writes = [op for op in ops if op.type == "AssignSubVariableOp"]
    assert len(writes) == owners
    assert {short_name(op.device) for op in writes} <= weight_devices

    # the layers' forward ops run on their planned devices, wherever the weights live
    forward = [op for op in graph.get_operations()
               if op.type == "MatMul" and not op.name.startswith("gradients")]
    compute = set(planned_devices(plan, wrapped).values())
    assert forward and {short_name(op.device) for op in forward} == compute
def test_without_offload_the_update_runs_on_the_weights_devices():
    """The same checks fail without offload: the contrast that makes them meaningful."""
    module, model = base_model("tiny_mlp")
    wrapped = apply.wrap(model, make_plan(model, [cpus(1)]))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert {_device(v) for v in slots(wrapped.optimizer)} == {"/device:CPU:1"}
    x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
    math = [op for op in update_ops(wrapped, train_step_graph(wrapped, x, y))
            if op.type not in NOT_MATH]
    assert math and {short_name(op.device) for op in math} == {"/device:CPU:1"}


def test_host_device_is_the_workers_cpu_zero():
    assert host_device("/device:GPU:3") == "/device:CPU:0"
    assert host_device("/device:CPU:5") == "/device:CPU:0"
    assert short_name(host_device("/job:worker/task:1/device:GPU:2")) == \
        "/job:worker/task:1/device:CPU:0"


def test_data_parallel_offload_runs_as_copies_on_the_spmd_engine():
    _, model = base_model("tiny_mlp")
    plan = offloaded(plans(model)["dp2"])
    assert execution_mode(plan).mode == "data_parallel"
    assert type(apply.wrap(model, plan)).__name__ == "SpmdModel"


def test_offload_plans_apply_cannot_run_are_refused():
    from tfplan.core.presets import parse_cluster

    _, model = base_model("tiny_mlp")
    tp2 = tp_plan(model, [cpus(1, 2)], (("dense_in", "column"), ("hidden", "row")))
    with pytest.raises(PlanMismatchError, match="optimizer\\+weights.*tp=2.*shard"):
        apply.wrap(model, offloaded(tp2, "optimizer+weights"))
    # ZeRO on a pipeline whose stages lie on both workers: one program per worker runs it
    staged = dataclasses.replace(
        make_plan(model, [[f"/job:worker/task:{w}/device:CPU:{i}" for i in range(2)]
                          for w in range(2)]), cluster=parse_cluster("2xcpu:2"))
    staged = offloaded(dataclasses.replace(staged, strategy=dataclasses.replace(
        staged.strategy, zero_stage=1)))
    assert unapplied(staged, execution_mode(staged)) == []


def test_an_offloaded_model_is_compiled_without_xla():
    """One XLA cluster runs on one device, and the update runs on the host."""
    module, model = base_model("tiny_mlp")
    wrapped = apply.wrap(model, offloaded(make_plan(model, [cpus(1)])))
    with pytest.warns(UserWarning, match="one XLA cluster runs on one device"):
        wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss, jit_compile=True)
    assert wrapped.jit_compile is False


def test_tensor_parallel_offload_keeps_the_shards_on_their_ranks():
    module, model = base_model("tiny_mlp")
    splits = (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
              ("head", "row"))
    wrapped = apply.wrap(model, offloaded(tp_plan(model, [cpus(1, 2)], splits)))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)),
                        helpers.reference_losses("tiny_mlp", STEPS))
    assert {_device(v) for v in wrapped.trainable_variables} == {"/device:CPU:1",
                                                                 "/device:CPU:2"}
    optimizer_slots = slots(wrapped.optimizer)
    assert len(optimizer_slots) == 2 * len(wrapped.trainable_variables)
    assert {_device(v) for v in optimizer_slots} == {HOST}
