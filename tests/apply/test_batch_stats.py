"""BatchNormalization under a plan, on the SPMD engine (``apply.spmd.batch_norm``; across
workers the older engine's ``apply.batch_stats``).

A tiny ResNet with four BatchNormalization layers trains 10 steps under dp=4, a pp=2
pipeline with 2 micro-batches and dp2 x pp2 with ``batch_norm: global``: the losses and
every weight (moving statistics included) equal one device's within 1e-4, and the
wrapped model's ``predict`` equals a plain model's loaded from its saved weights.
``local`` differs from one device (and says so), yet keeps one moving-statistics value
across replicas and copies.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.apply.helpers import base_model, cpus, fresh_optimizer, make_plan

STEPS = 10
BATCH = 16
SHAPES = {  # name: (stage devices, micro-batches)
    "dp4": ([cpus(0, 1, 2, 3)], 1),
    "pp2 m2": ([cpus(0), cpus(1)], 2),
    "dp2 x pp2": ([cpus(0, 1), cpus(2, 3)], 2),
}


def batches(module):
    """Batches whose statistics differ (a shifted mean each step), so per-part statistics
    could not pass for the whole batch's."""
    x, y = module.sample_batch(STEPS * BATCH)
    return [(x[i * BATCH:(i + 1) * BATCH] + 0.3 * i, y[i * BATCH:(i + 1) * BATCH])
            for i in range(STEPS)]


def fresh_copy(module, model):
    import keras

    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def train(model, module):
    model.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for x, y in batches(module)]


@pytest.fixture(scope="module")
def reference():
    module, model = base_model("tiny_resnet_bn")
    one = fresh_copy(module, model)
    losses = train(one, module)
    return losses, one.get_weights(), one


def plan_for(model, shape: str, batch_norm: str = "global", schedule: str | None = None):
    stages, m = SHAPES[shape]
    plan = make_plan(model, stages, num_microbatches=m, global_batch=BATCH)
    strategy = dataclasses.replace(plan.strategy, batch_norm=batch_norm,
                                   schedule=schedule or plan.strategy.schedule)
    return dataclasses.replace(plan, strategy=strategy)


def _statistics(wrapped):
    """How the wrapped model computes batch statistics: "global" / "local", or None where
    nothing is installed (no BatchNormalization); on the SPMD engine, the plan's rule where
    its copies' BatchNormalization layers follow it (summed over the dp group, or each
    part's own) or where its micro-batches run joined for them."""
    from tfplan.apply.spmd import SpmdModel
    from tfplan.apply.spmd.batch_norm import GroupBatchNormalization

    if not isinstance(wrapped, SpmdModel):
        return wrapped.batch_norm
    grouped = any(isinstance(layer, GroupBatchNormalization)
                  for copy in wrapped.device_models for layer in copy.layers)
    run = wrapped.run_description
    return run.batch_norm if grouped or run.joined_microbatches > 1 else None


def moving_statistics(wrapped):
    """Every copy of every moving statistic: each MirroredStrategy replica's component,
    each data-parallel copy's variable."""
    import tensorflow as tf

    out = {}
    copies = getattr(wrapped, "device_models", None)  # the SPMD engine's (apply.spmd)
    for model in copies if copies is not None else wrapped.replica_models():
        for layer in model.layers:
            for v in getattr(layer, "non_trainable_variables", []):
                value = v.value
                parts = value.values if isinstance(value, tf.distribute.DistributedValues) \
                    else (value,)
                out.setdefault(v.path, []).extend(p.numpy() for p in parts)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_global_statistics_train_like_one_device(shape, reference, tmp_path):
    import keras

    from tfplan import apply

    ref_losses, ref_weights, one = reference
    module, model = base_model("tiny_resnet_bn")
    wrapped = apply.wrap(fresh_copy(module, model), plan_for(model, shape))
    assert type(wrapped).__name__ == "SpmdModel"  # every shape on the SPMD engine
    assert _statistics(wrapped) == "global"
    losses = train(wrapped, module)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for got, want in zip(wrapped.get_weights(), ref_weights):  # moving statistics included
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for path, copies in moving_statistics(wrapped).items():  # one value everywhere
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0], err_msg=path)
    # predict (inference: the moving statistics) == a plain model from the saved weights
    wrapped.save_weights(tmp_path / "trained.weights.h5")
    plain = module.build_model()
    plain.load_weights(tmp_path / "trained.weights.h5")
    x, _ = module.sample_batch(BATCH)
    predicted = wrapped.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(predicted, plain.predict(x, batch_size=BATCH, verbose=0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(predicted, one.predict(x, batch_size=BATCH, verbose=0),
                               rtol=1e-4, atol=1e-5)
    del keras


def test_fit_under_data_parallelism_equals_one_device(reference):
    """``fit`` (Keras' own loop over the distributed dataset) runs the same step."""
    import keras

    from tfplan import apply

    module, model = base_model("tiny_resnet_bn")
    x = np.concatenate([b[0] for b in batches(module)])
    y = np.concatenate([b[1] for b in batches(module)])
    results = []
    for build in (lambda: fresh_copy(module, model),
                  lambda: apply.wrap(fresh_copy(module, model), plan_for(model, "dp4"))):
        m = build()
        m.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        history = m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], m.get_weights()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-4)
    for got, want in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    del keras


@pytest.mark.parametrize("shape", ["dp4", "dp2 x pp2"])
def test_local_statistics_differ_from_one_device_but_stay_one_value(shape, reference):
    from tfplan import apply

    ref_losses, _, _ = reference
    module, model = base_model("tiny_resnet_bn")
    with pytest.warns(UserWarning, match="per replica and micro-batch"):
        wrapped = apply.wrap(fresh_copy(module, model), plan_for(model, shape, "local"))
    assert type(wrapped).__name__ == "SpmdModel"
    losses = train(wrapped, module)
    # per-part statistics: the first step's loss already differs
    assert abs(losses[0] - ref_losses[0]) > 1e-3 * abs(ref_losses[0])
    stats = moving_statistics(wrapped)
    assert any(len(copies) > 1 for copies in stats.values())
    for path, copies in stats.items():
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0], err_msg=path)
    # and they moved: not the initial zeros / ones
    assert any(np.abs(copies[0]).max() > 0 for p, copies in stats.items() if "mean" in p)


def test_a_1f1b_plan_runs_in_gpipe_order_and_says_so(reference):
    from tfplan import apply

    ref_losses, ref_weights, _ = reference
    module, model = base_model("tiny_resnet_bn")
    with pytest.warns(UserWarning, match="GPipe order"):
        wrapped = apply.wrap(fresh_copy(module, model), plan_for(model, "pp2 m2",
                                                                 schedule="1f1b"))
    np.testing.assert_allclose(train(wrapped, module), ref_losses, rtol=1e-4)


def test_a_model_without_batch_norm_is_untouched():
    from tfplan import apply

    module, model = base_model("tiny_cnn")
    wrapped = apply.wrap(fresh_copy(module, model), make_plan(model, [cpus(0, 1)]))
    assert _statistics(wrapped) is None


def test_what_cannot_be_applied_is_refused_by_name():
    import keras

    from tfplan import apply
    from tfplan.core.errors import PlannerError

    inputs = keras.Input((4,))
    renorm = keras.Model(inputs, keras.layers.Dense(2)(
        keras.layers.BatchNormalization(renorm=True, name="renormed")(inputs)))
    with pytest.raises(PlannerError, match="'renormed'.*renorm"):
        apply.wrap(renorm, make_plan(renorm, [cpus(0, 1)]))

    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, keras.layers.BatchNormalization(name="inner_bn")(inner_in),
                        name="block")
    outer_in = keras.Input((4,))
    nested = keras.Model(outer_in, keras.layers.Dense(2)(inner(outer_in)))
    with pytest.raises(PlannerError, match="'block/inner_bn'.*nested"):
        apply.wrap(nested, make_plan(nested, [cpus(0, 1)]))


def test_plan_files_without_batch_norm_read_as_global_and_bad_values_are_refused():
    from tfplan.core.errors import SchemaError
    from tfplan.planner.plan import Strategy

    d = Strategy(dp=2, tp=1, pp=1, microbatch_size=8, num_microbatches=1).to_dict()
    assert d["batch_norm"] == "global"
    d.pop("batch_norm")
    assert Strategy.from_dict(d).batch_norm == "global"
    with pytest.raises(SchemaError, match="batch_norm is 'sync'.*global"):
        Strategy.from_dict({**d, "batch_norm": "sync"})
