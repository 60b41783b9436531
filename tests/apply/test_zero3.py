"""ZeRO-3 through ``apply.wrap`` of a built model: one persistent copy of each weight in all,
gathered for each layer's forward and backward, training exactly like one device.

Plans without stages run on the SPMD engine (apply.spmd.zero3: each device holds 1/dp of
every weight; its own tests are tests/apply/spmd/test_zero.py): weight files, a nested
model, a layer called twice and the refusals here, and a ZeRO-3 pipeline (dp = 2 x pp = 2
in 1F1B order, on the transformer: each chunk's layers gathered per micro-batch).
Memory is measured on the variables the replicas' layers hold (each distinct variable with
storage of its own, by its device), not taken from the owners' table.
"""
from __future__ import annotations

import collections
import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply, compat
from tfplan.apply.device_names import short_name
from tfplan.apply.dimensions import unapplied
from tfplan.apply.mode import Processes, execution_mode
from tfplan.apply.placement import tf_variable
from tfplan.core.errors import PlannerError
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, step_losses, tp_plan)

STEPS = 10
MLP_SPLITS = (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
              ("head", "row"))

# name: (model file, devices of each stage (dp x tp), micro-batches, dp, splits)
CASES = {
    "transformer-dp2-pp2-1f1b": ("tiny_transformer", [cpus(0, 1), cpus(2, 3)], 2, 2, ()),
}


def zero3_plan(model, devices, *, dp, num_microbatches=1, splits=()):
    """ZeRO-3 over ``devices`` (one stage's dp x tp devices, or a list of stages';
    several stages run 1F1B)."""
    stages = devices if isinstance(devices[0], list) else [devices]
    plan = tp_plan(model, stages, splits, dp=dp, zero=True,
                   num_microbatches=num_microbatches, global_batch=GLOBAL_BATCH,
                   name=f"zero3 dp={dp} tp={len(stages[0]) // dp} pp={len(stages)} "
                        f"m={num_microbatches}")
    return dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, zero_stage=3, schedule="1f1b" if len(stages) > 1 else "none"))


def _device(variable) -> str:
    return short_name(tf_variable(variable).device)


def _nbytes(variable) -> int:
    return int(np.prod(variable.shape, dtype=np.int64)) * tf.as_dtype(variable.dtype).size


def _held_bytes(wrapped) -> int:
    """Weight bytes the wrapped model holds in all: its copies' variables with storage, and
    on the SPMD engine its ZeRO-3 shards (each copy's own weights freed)."""
    copies = getattr(wrapped, "device_models", None)
    held = sum(_measured_bytes(copies if copies is not None else
                               wrapped.replica_models()).values())
    if copies is not None:
        held += sum(_nbytes(s) for row in wrapped._zero.shards for shards in row
                    for s in shards)
    return held


def _measured_bytes(replicas) -> dict[str, int]:
    """Bytes of every distinct variable with storage the replicas' layers hold, by the
    device its tf.Variable lives on."""
    seen, out = set(), collections.Counter()
    for model in replicas:
        for layer in model.layers:
            for v in layer.weights:
                if compat.holds_storage(v) and id(v.value) not in seen:
                    seen.add(id(v.value))  # its storage's size (freed storage is empty)
                    out[short_name(v.value.device)] += _nbytes(v.value)
    return dict(out)


# transformer-dp4: the transformer runs by default with dp = 4 and 2 micro-batches, one
# micro-batch runs by default on the MLP
SLOW = {"transformer-dp4"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_zero3_trains_like_one_device_with_one_copy_of_each_weight(case):
    """A ZeRO-3 pipeline on the SPMD engine: every copy's own weights freed, each device
    holding its chunk's shards, 1/dp of its chunk's weights (up to each weight's padding
    row), nothing re-materialised by training, which equals one device's (losses, weights);
    the optimizer state is the shards', beside them."""
    from tfplan.apply.spmd import SpmdModel

    name, devices, m, dp, splits = CASES[case]
    module, model = base_model(name)
    plan = zero3_plan(model, devices, dp=dp, num_microbatches=m, splits=splits)
    assert execution_mode(plan).mode == "tensor_parallel" and unapplied(plan) == []
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel) and wrapped.run_description.zero_stage == 3
    zero = wrapped._zero

    def held() -> dict[str, int]:
        assert not any(_measured_bytes(wrapped.device_models).values())  # copies freed
        out = collections.Counter()
        for row in zero.shards:
            for shards in row:
                for shard in shards:
                    out[_device(shard)] += _nbytes(shard)
        return dict(out)

    measured = held()
    assert set(measured) == {d for stage in devices for d in stage}  # each holds a share
    for q, row in enumerate(zero.weights):
        for t, weights in enumerate(row):
            for device in set(zero.devices[q][t]):
                mine = [(w, cut) for w, cut, d in zip(weights, zero.cuts[q][t],
                                                      zero.devices[q][t]) if d == device]
                whole = sum(_nbytes(w) for w, _ in mine)
                padding = sum(_nbytes(w) // max(1, w.shape[0] if len(w.shape) else 1)
                              for w, _ in mine)  # a row each at most
                assert whole / dp <= measured[device] <= whole / dp + padding, device
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH)),
                        helpers.reference_losses(name, STEPS))
    optimizer = wrapped.optimizer
    assert {id(v) for v in optimizer._trainable_variables} == {id(s) for s in zero.variables}
    for shard in zero.variables:
        index = optimizer._get_variable_index(shard)
        for slots in (optimizer._momentums, optimizer._velocities):
            assert _device(slots[index]) == _device(shard)
    assert held() == measured  # nothing re-materialised
    _, reference = helpers.single_device_copy(name)
    for x, y in batches_of(module, STEPS, GLOBAL_BATCH):
        reference.train_on_batch(x, y)
    for mine, theirs in zip(wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


def test_zero3_weight_files_are_the_one_device_models(tmp_path):
    """save_weights of a ZeRO-3 model (weights and Adam's state) loads into the plain
    model as one device's training left it; load_weights reads it back into the owners."""
    module, model = base_model("tiny_transformer")
    steps = 3
    wrapped = apply.wrap(model, zero3_plan(model, cpus(0, 1, 2, 3), dp=4))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    _, reference = helpers.single_device_copy("tiny_transformer")
    for x, y in batches_of(module, steps, GLOBAL_BATCH):
        wrapped.train_on_batch(x, y)
        reference.train_on_batch(x, y)
    path = str(tmp_path / "zero3.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(path)
    for mine, theirs in zip(plain.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(plain.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-3, atol=1e-6)
    # and back into a fresh ZeRO-3 model: the owners get the values
    again = apply.wrap(model, zero3_plan(model, cpus(4, 5, 6, 7), dp=4))
    again.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    again.load_weights(path)
    for mine, theirs in zip(again.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
    # one copy of each weight in all (the shards' padding to equal rows aside)
    assert 1 <= _held_bytes(again) / sum(_nbytes(v) for v in model.trainable_weights) < 1.05


def test_zero3_refuses_layers_with_state_and_runs_one_program_per_worker():
    _, bn = base_model("tiny_resnet_bn")
    with pytest.raises(PlannerError, match="stem_norm.*non-trainable state.*--zero-stage 2"):
        apply.wrap(bn, zero3_plan(bn, cpus(0, 1), dp=2))
    from tfplan.core.presets import parse_cluster

    _, mlp = base_model("tiny_mlp")
    workers = dataclasses.replace(
        zero3_plan(mlp, [f"/job:worker/task:{w}/device:CPU:0" for w in range(2)], dp=2),
        cluster=parse_cluster("2xcpu:1"))
    # across workers ZeRO-3 runs one program per worker (tests/apply/test_workers.py)
    assert execution_mode(workers).processes is Processes.PER_WORKER
    assert unapplied(workers, execution_mode(workers)) == []


def test_zero3_gathers_a_nested_model_and_a_layer_called_twice():
    """A nested model's weights are gathered for the whole nested call, and a layer called
    twice gathers (and re-gathers) its weights at each call, its gradients summed over
    both calls and both replicas on the owner: the losses are one device's."""
    keras.utils.set_random_seed(1)
    inner_in = keras.Input((8,))
    trunk = keras.Model(inner_in, keras.layers.Dense(8, activation="relu", name="hidden")(
        inner_in), name="trunk")
    x = keras.Input((6,))
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h = shared(shared(trunk(keras.layers.Dense(8, name="pre")(x))))
    model = keras.Model(x, keras.layers.Dense(2, name="head")(h), name="nested_shared")
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    plan = zero3_plan(model, cpus(2, 3), dp=2)
    wrapped = apply.wrap(model, plan)
    for m in (wrapped, reference):
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    xs = np.random.default_rng(0).normal(size=(STEPS * GLOBAL_BATCH, 6)).astype("float32")
    batches = [(xs[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH],
                2 * xs[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH, :2]) for i in range(STEPS)]
    assert_losses_match(step_losses(wrapped, batches), step_losses(reference, batches))
    assert 1 <= _held_bytes(wrapped) / sum(_nbytes(v) for v in model.trainable_weights) < 1.05
