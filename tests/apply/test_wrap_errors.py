"""apply.wrap refuses what it cannot do, with typed errors that say what to fix."""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Stage, Strategy
from tests.apply.helpers import assert_losses_match, base_model, cpus, fresh_optimizer, make_plan


def test_plan_for_another_model_names_the_first_differing_layer():
    _, mlp = base_model("tiny_mlp")
    _, cnn = base_model("tiny_cnn")
    with pytest.raises(PlanMismatchError) as err:
        apply.wrap(mlp, make_plan(cnn, [cpus(1), cpus(2)]))
    message = str(err.value)
    assert "layer 0" in message and "'stem'" in message and "'dense_in'" in message


def test_plan_whose_stages_miss_a_layer():
    _, mlp = base_model("tiny_mlp")
    plan = make_plan(mlp, [cpus(1), cpus(2)],
                     stage_layers=[["dense_in", "hidden"], ["head"]])
    with pytest.raises(PlanMismatchError, match="'narrow' are in no stage"):
        apply.wrap(mlp, plan)


def test_plan_naming_a_device_that_does_not_exist_lists_the_devices():
    _, mlp = base_model("tiny_mlp")
    with pytest.raises(PlanMismatchError) as err:
        apply.wrap(mlp, make_plan(mlp, [["/device:CPU:0", "/device:CPU:63"]], cluster_size=64))
    message = str(err.value)
    assert "/device:CPU:63" in message
    assert all(f"/device:CPU:{i}" in message for i in range(8))


def test_a_tensor_parallel_plan_with_too_few_devices_per_stage_is_a_mismatch():
    _, mlp = base_model("tiny_mlp")
    plan = make_plan(mlp, [cpus(0)])  # one device per stage, but tp=2 needs two
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, tp=2))
    with pytest.raises(PlanMismatchError, match="tp"):
        apply.wrap(mlp, plan)


def test_inconsistent_strategy_and_stages():
    _, mlp = base_model("tiny_mlp")
    plan = make_plan(mlp, [cpus(1), cpus(2)])
    bad = dataclasses.replace(plan, strategy=Strategy(dp=1, tp=1, pp=3, microbatch_size=16,
                                                      num_microbatches=1))
    with pytest.raises(PlanMismatchError, match="pp=3"):
        apply.wrap(mlp, bad)
    twice = dataclasses.replace(plan, stages=(plan.stages[0],
                                              Stage(plan.stages[1].layers, ("/device:CPU:1",))))
    with pytest.raises(PlanMismatchError, match="used by stage 0 and again by stage 1"):
        apply.wrap(mlp, twice)


def test_subclassed_model_is_refused():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    model = Sub()
    model(np.zeros((1, 3), "float32"))
    plan = make_plan(model, [cpus(1)])
    with pytest.raises(PlannerError, match="Functional or Sequential"):
        apply.wrap(model, plan)


@pytest.fixture(scope="module")
def dp4():
    module, mlp = base_model("tiny_mlp")
    wrapped = apply.wrap(mlp, make_plan(mlp, [cpus(0, 1, 2, 3)]))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return module, wrapped


@pytest.fixture(scope="module")
def pp2_m4():
    module, mlp = base_model("tiny_mlp")
    wrapped = apply.wrap(mlp, make_plan(mlp, [cpus(1), cpus(2)], num_microbatches=4))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return module, wrapped


def _fresh(fixture):
    """A new wrapped model of the fixture's plan and a one-device twin with its weights."""
    module, mlp = base_model("tiny_mlp")
    stages, m = {"dp4": ([cpus(0, 1, 2, 3)], 1), "pp2_m4": ([cpus(1), cpus(2)], 4)}[fixture]
    wrapped = apply.wrap(mlp, make_plan(mlp, stages, num_microbatches=m))
    reference = keras.models.clone_model(mlp)
    reference.set_weights(wrapped.get_weights())
    for model in (wrapped, reference):
        model.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return module, wrapped, reference


@pytest.mark.parametrize("fixture", ["dp4", "pp2_m4"])
def test_a_batch_that_does_not_split_evenly_trains_like_one_device(fixture):
    """The SPMD engine cuts any batch into dp x m parts of nearly equal rows, each part's
    loss weighed by its rows: batches of 10, 6 (and a last one of 6 of 18) and a dataset's
    batches of 10 train like one device."""
    module, wrapped, reference = _fresh(fixture)
    x, y = module.sample_batch(20)
    assert_losses_match([wrapped.train_on_batch(x[:10], y[:10])],
                        [reference.train_on_batch(x[:10], y[:10])])
    for batch_size in (6, 8):
        got, want = (m.fit(x[:18], y[:18], batch_size=batch_size, shuffle=False, verbose=0)
                     for m in (wrapped, reference))
        assert_losses_match(got.history["loss"], want.history["loss"])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10, drop_remainder=True)
    got, want = (m.fit(dataset, verbose=0) for m in (wrapped, reference))
    assert_losses_match(got.history["loss"], want.history["loss"])


@pytest.mark.parametrize("fixture", ["dp4", "pp2_m4"])
def test_inference_has_no_batch_rule(fixture, request):
    module, wrapped = request.getfixturevalue(fixture)
    _, model = base_model("tiny_mlp")
    x, y = module.sample_batch(6)
    expected = model.predict_on_batch(x)
    np.testing.assert_allclose(wrapped.predict_on_batch(x), expected, rtol=1e-5, atol=1e-6)
    loss = wrapped.test_on_batch(x, y, return_dict=True)["loss"]
    np.testing.assert_allclose(loss, np.mean((expected - y) ** 2), rtol=1e-5)


def test_a_generators_batch_that_does_not_split_evenly_trains_like_one_device():
    module, wrapped, reference = _fresh("pp2_m4")
    x, y = module.sample_batch(6)

    def batches():
        yield x, y

    got, want = (m.fit(batches(), steps_per_epoch=1, shuffle=False, verbose=0)
                 for m in (wrapped, reference))
    assert_losses_match(got.history["loss"], want.history["loss"])


def test_layer_that_cannot_be_recreated_is_named():
    class Box:  # not serializable, so Keras cannot record Scale's config by itself
        value = 2.0

    class Scale(keras.layers.Layer):  # nor does it keep its argument under its own name
        def __init__(self, factor, **kwargs):
            super().__init__(**kwargs)
            self._factor = factor

        def call(self, x):
            return x * self._factor.value

    inputs = keras.Input(shape=(3,))
    model = keras.Model(inputs, Scale(Box(), name="scale")(keras.layers.Dense(3)(inputs)))
    with pytest.raises(PlannerError, match="layer 'scale' \\(Scale\\)"):
        apply.wrap(model, make_plan(model, [cpus(1)]))


def test_memory_savers_are_applied_on_one_host_and_across_workers(recwarn):
    from tfplan.apply.mode import execution_mode
    from tfplan.core.presets import parse_cluster

    _, mlp = base_model("tiny_mlp")
    plan = make_plan(mlp, [cpus(0, 1)])
    saver = dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, recompute="full", zero_stage=1, schedule="1f1b"))
    # ZeRO-1 runs on the replicated machinery
    assert execution_mode(saver).mode == "tensor_parallel"
    assert not [w for w in recwarn if "does not apply" in str(w.message)]
    workers = dataclasses.replace(
        make_plan(mlp, [[f"/job:worker/task:{w}/device:CPU:0" for w in range(2)]]),
        cluster=parse_cluster("2xcpu:1"))
    workers = dataclasses.replace(workers, strategy=dataclasses.replace(
        workers.strategy, zero_stage=1))
    # ZeRO-1 across workers: one program per worker (apply.spmd), no warning
    assert execution_mode(workers).mode == "tensor_parallel"
    assert not [w for w in recwarn if "does not apply" in str(w.message)]
