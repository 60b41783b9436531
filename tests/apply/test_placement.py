"""apply.wrap runs general placements on the SPMD engine (a pipeline of one-device chunks cut
where the device changes: apply.spmd.stages.placement_segments): the searched one and
hand-made non-contiguous ones train exactly like one device, with every variable, slot and
branch op on its device, and each device sends the bytes planner.traffic prices.

The model is tests/apply/branchy.py (a stem, two wide independent Dense branches, a
Concatenate, a head), on the 8 logical CPU devices of tests/conftest.py.
"""
from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.mode import execution_mode
from tfplan.core.errors import PlanMismatchError
from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tests.apply.helpers import (GLOBAL_BATCH, HERE, STEPS, assert_losses_match, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan,
                                 reference_losses, step_losses)
from tests.apply.test_wrap_modes import _short


def _assert_placement(model, plan) -> None:
    """Every layer's weights on its planned device (one device per stage), each optimizer
    slot beside its variable (``apply.variable_devices``: the SPMD engine's copies)."""
    layer_device = plan.device_of_layer()
    where = apply.variable_devices(model)
    weights = {path: devices for path, devices in where.items()
               if path.split("/")[0] in layer_device}
    assert weights
    for path, devices in weights.items():
        assert [_short(d) for d in devices] == [layer_device[path.split("/")[0]]], path
    prefix = model.optimizer.name + "/"
    for path, devices in weights.items():
        slots = [p for p in where if p.startswith(prefix + path.replace("/", "_") + "_")]
        assert slots, f"no optimizer slot found for {path}"
        for slot in slots:
            assert where[slot] == devices, (slot, path)


def _cpu(spec: str):
    """Logical CPU devices priced as if each had its own cores (as GPUs do): on this host
    they share them (``devices_per_compute_pool``), which no placement can beat."""
    import dataclasses
    return dataclasses.replace(parse_cluster(spec), devices_per_compute_pool=1)

NAME = "branchy"


@pytest.fixture(scope="module")
def searched_plan():
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    profile = profile_source(load_model_source(os.path.join(HERE, f"{NAME}.py")), batch_size=1)
    result = search(profile, _cpu("cpu:2"), GLOBAL_BATCH)
    (plan,) = [p for p in result.candidates if p.placement == "general"]
    return plan


def _hand_made(layers_per_device: dict[str, tuple[str, ...]]):
    _, model = base_model(NAME)
    devices = list(layers_per_device)
    plan = make_plan(model, [[d] for d in devices], global_batch=GLOBAL_BATCH,
                     stage_layers=[layers_per_device[d] for d in devices],
                     name=f"test general placement on {len(devices)} devices")
    return replace(plan, placement="general")


HAND_MADE = {  # stage layers that are not runs of consecutive layers
    "stem+branch_1+head|branch_0+merge": {cpus(3)[0]: ("stem", "branch_1", "head"),
                                          cpus(1)[0]: ("branch_0", "merge")},
    "three devices": {cpus(2)[0]: ("stem", "head"), cpus(4)[0]: ("branch_0",),
                      cpus(7)[0]: ("branch_1", "merge")},
}


def _train_and_check(plan):
    module, model = base_model(NAME)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel) and execution_mode(plan).mode == "placement"
    assert wrapped.run_description.num_microbatches == 1
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    _assert_priced_bytes(wrapped, plan, module.build_model(), batches[0])
    assert_losses_match(step_losses(wrapped, batches), reference_losses(NAME))
    _assert_placement(wrapped, plan)  # weights, and each optimizer slot with its variable
    return wrapped, batches


def _assert_priced_bytes(wrapped, plan, model, batch):
    """The audit of one step: every device's activation hops (kind pp) within 10% of
    planner.traffic's price, nothing unattributed."""
    from tfplan.apply.audit import audit_step
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    priced = {d: dict(kinds) for d, kinds in
              plan_sent_bytes(profile_model(model, batch_size=GLOBAL_BATCH), plan)}
    measured = audit_step(wrapped, *batch, plan=plan).by_device()
    for device, kinds in priced.items():
        assert kinds["pp"] > 0, device
        got = measured[device]
        assert got["pp"] == pytest.approx(kinds["pp"], rel=0.10), (device, got, kinds)
        assert got["other"] == 0, (device, got)


def _ancestors(op) -> set:
    seen, todo = set(), [op]
    while todo:
        child = todo.pop()
        for parent in [t.op for t in child.inputs] + list(child.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _branch_ops_are_placed_and_independent(wrapped, batch, plan):
    """Trace one train step: each branch's forward and gradient MatMuls run on the
    branch's planned device, and no path in the graph orders one branch's forward
    MatMul after the other's (the executor may run them at the same time)."""
    x, y = batch
    graph = tf.function(wrapped.train_step).get_concrete_function(
        (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))).graph
    where = plan.device_of_layer()
    forward = {}
    for branch in ("branch_0", "branch_1"):
        scope = re.compile(rf"(^|/){branch}(_\d+)?/")  # Keras may suffix a traced scope
        matmuls = [op for op in graph.get_operations() if op.type == "MatMul"
                   and scope.search(op.name)]
        assert len(matmuls) >= 3, [op.name for op in matmuls]  # forward + 2 gradients
        for op in matmuls:
            assert _short(op.device) == where[branch], (op.name, op.device)
        forward[branch] = next(op for op in matmuls if "gradients" not in op.name)
    assert forward["branch_0"] not in _ancestors(forward["branch_1"])
    assert forward["branch_1"] not in _ancestors(forward["branch_0"])


def test_searched_general_placement_trains_like_one_device(searched_plan):
    where = searched_plan.device_of_layer()
    assert where["branch_0"] != where["branch_1"]
    wrapped, batches = _train_and_check(searched_plan)
    _branch_ops_are_placed_and_independent(wrapped, batches[0], searched_plan)


@pytest.mark.parametrize("case", list(HAND_MADE))
def test_non_contiguous_placements_train_like_one_device(case):
    plan = _hand_made(HAND_MADE[case])
    wrapped, batches = _train_and_check(plan)
    _branch_ops_are_placed_and_independent(wrapped, batches[0], plan)


def test_general_placement_with_microbatches_is_refused():
    plan = _hand_made(HAND_MADE["three devices"])
    broken = replace(plan, strategy=replace(plan.strategy, num_microbatches=2,
                                            microbatch_size=GLOBAL_BATCH // 2))
    _, model = base_model(NAME)
    with pytest.raises(PlanMismatchError, match="num_microbatches=2"):
        apply.wrap(model, broken)


def test_a_value_read_on_one_device_by_two_of_its_chunks_goes_there_once():
    """a (device A) feeds b (B) and, later, d (B again: a chunk of its own after c on A):
    its activation goes to B once and one summed gradient comes back (apply.spmd.pipeline),
    as planner.traffic prices it; training equals one device."""
    import keras
    import numpy as np

    def build():
        keras.utils.set_random_seed(3)
        x = keras.Input((16,))
        a = keras.layers.Dense(32, activation="relu", name="a")(x)
        b = keras.layers.Dense(32, activation="relu", name="b")(a)
        c = keras.layers.Dense(32, activation="relu", name="c")(b)
        d = keras.layers.Add(name="d")([c, a])
        return keras.Model(x, keras.layers.Dense(4, name="head")(d))

    model = build()
    A, B = cpus(1)[0], cpus(2)[0]
    plan = replace(make_plan(model, [[A], [B]], global_batch=GLOBAL_BATCH,
                             stage_layers=[("a", "c"), ("b", "d", "head")],
                             name="test placement A B A B"), placement="general")
    wrapped = apply.wrap(build, plan)
    assert isinstance(wrapped, SpmdModel)
    assert [grid[0][0] for grid in wrapped.run_description.stages] == [A, B, A, B]
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(GLOBAL_BATCH, 16)).astype("float32"),
                rng.normal(size=(GLOBAL_BATCH, 4)).astype("float32")) for _ in range(3)]
    reference = build()
    reference.set_weights(wrapped.get_weights())
    for target in (wrapped, reference):
        target.compile(optimizer="adam", loss="mse")
    _assert_priced_bytes(wrapped, plan, build(), batches[0])
    assert_losses_match(step_losses(wrapped, batches), step_losses(reference, batches))
