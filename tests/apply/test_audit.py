"""apply.audit: the bytes each device sends in one step, measured from what TensorFlow ran.

A miniature SPMD data-parallel step (every device runs its own rows, gradients meet in
``apply.collective_ops.all_reduce`` over the plan's dp group) is audited against the
bytes ``planner.traffic`` prices for the same plan from the model's profile: they must
agree, device by device. A step of cross-device copies is counted at their sizes, the
reduce-scatter's CPU stand-in as the collective it stands for, and the audit leaves the
model as it found it."""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan.apply import collective_ops
from tfplan.apply.audit import audit_step
from tfplan.apply.groups import groups_of
from tfplan.planner.traffic import sent_bytes_per_device
from tfplan.profiler import profile_model
from tests.apply.helpers import cpus, make_plan


def _mlp() -> keras.Model:
    inputs = keras.Input(shape=(12,), name="x")
    h = keras.layers.Dense(32, activation="tanh", name="d1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="d2")(h), name="mlp")


class CollectiveDataParallel(keras.Model):
    """One copy of ``build()`` per device of the plan's dp group: each runs its rows of the
    batch (cut on the host under ``tfplan_input``), gradients are all-reduced in the group,
    and each copy takes the same SGD step on its own device."""

    def __init__(self, plan, build, lr=0.1):
        super().__init__(name="collective_dp")
        self.group = groups_of(plan).of_kind("dp")[0]
        self.lr = lr
        self.copies = []
        for d in self.group.devices:
            with tf.device(d):
                keras.utils.set_random_seed(0)
                m = build()
            self.copies.append(m)

    def call(self, x):
        return self.copies[0](x)

    def train_step(self, data):
        x, y = data[0], data[1]
        n = self.group.size
        with tf.name_scope("tfplan_input"):
            xs, ys = tf.split(x, n), tf.split(y, n)
        grads, losses = [], []
        for i, (m, d) in enumerate(zip(self.copies, self.group.devices)):
            with tf.device(d):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(m(xs[i]) - ys[i])) / n
                grads.append(tape.gradient(loss, m.trainable_variables))
                losses.append(loss)
        for j in range(len(grads[0])):
            summed = collective_ops.all_reduce([g[j] for g in grads], self.group)
            for m, d, g in zip(self.copies, self.group.devices, summed):
                with tf.device(d):
                    m.trainable_variables[j].assign_sub(self.lr * g)
        total = collective_ops.all_reduce(losses, self.group, kind="dp")[0]
        return {"loss": total}


@pytest.mark.parametrize("n", [2, 4])
def test_collective_data_parallel_sends_what_the_plan_prices(n):
    model = _mlp()
    plan = make_plan(model, [cpus(*range(n))], global_batch=16)
    wrapped = CollectiveDataParallel(plan, _mlp)
    wrapped.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 12)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")
    before = [v.numpy().copy() for v in wrapped.variables]
    audit = audit_step(wrapped, x, y, plan=plan)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, wrapped.variables))
    profile = profile_model(model, batch_size=16)
    priced = dict(sent_bytes_per_device(profile, plan.strategy, [(0, len(profile.layers))],
                                        ("",) * len(profile.layers), [plan.stages[0].devices]))
    measured = audit.by_device()
    grad_bytes = 4 * model.count_params()
    for d in plan.stages[0].devices:
        assert dict(priced[d])["dp"] == round(2 * (n - 1) / n * grad_bytes)
        # the gradients' ring volume, plus the loss's (4 bytes, all-reduced for the log)
        assert measured[d]["dp"] == pytest.approx(dict(priced[d])["dp"] + 2 * (n - 1) / n * 4,
                                                  abs=1)
        assert measured[d]["other"] == measured[d]["tp"] == measured[d]["pp"] == 0
    # the batch's rows went out from the host (CPU:0) to the other devices, as "input"
    assert measured[cpus(0)[0]]["input"] > 0
    assert audit.unsized == ()


def test_copies_count_their_size_and_the_reduce_scatter_stand_in_its_own_volume():
    model = _mlp()
    plan = make_plan(model, [cpus(0, 1, 2, 3)], global_batch=16)
    group = groups_of(plan).of_kind("dp")[0]

    class Step(keras.Model):
        def __init__(self):
            super().__init__()
            with tf.device(cpus(1)[0]):
                self.w = self.add_weight(shape=(8, 6), initializer="ones", name="w")

        def call(self, x):
            return x

        def train_step(self, data):
            x = data[0]  # [16, 12] float32 on the host
            with tf.device(cpus(0)[0]):
                a = tf.reduce_sum(x) * tf.ones([8, 6])  # 192 bytes, made on CPU:0
            with tf.device(cpus(1)[0]):
                b = a * self.w  # ... read on CPU:1: one copy of 192 bytes
            pieces = collective_ops.reduce_scatter([b, b * 2.0, b * 3.0, b * 4.0], group)
            sums = []
            for p, d in zip(pieces, group.devices):
                with tf.device(d):
                    sums.append(tf.reduce_sum(p))  # each member's own slice (2 x 6)
            return {"loss": tf.add_n(sums)}

    step = Step()
    step.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 12), "float32")
    audit = audit_step(step, x, x[:, :3], plan=plan)
    by = audit.by_device()
    copies = [t for t in audit.transfers if t.what.startswith("copy") and t.kind != "input"]
    assert any(t.sender == cpus(0)[0] and t.nbytes == 192 for t in copies)
    scatters = [t for t in audit.transfers if t.what.startswith("reduce_scatter")]
    assert len(scatters) == 4 and all(t.nbytes == 3 * 192 // 4 for t in scatters)  # (n-1)/n N
    assert {t.kind for t in scatters} == {"dp"}
    assert by[cpus(2)[0]]["dp"] == 3 * 192 // 4 + sum(
        t.nbytes for t in copies if t.sender == cpus(2)[0] and t.kind == "dp")


def test_audit_needs_a_compiled_model():
    with pytest.raises(ValueError, match="compiled model"):
        audit_step(_mlp(), np.ones((4, 12), "float32"), np.ones((4, 3), "float32"))
