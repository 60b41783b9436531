"""BatchNormalization on the SPMD engine (apply.spmd.batch_norm): under data parallelism
each layer's training statistics are the whole batch's, summed over the data-parallel
group, so training, the moving statistics and inference equal one device's; under "local"
each part's own statistics, the moving ones their mean (over micro-batches too); global
statistics over micro-batches join them."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfplan import apply
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.batch_norm import GroupBatchNormalization
from tfplan.apply.wrap import spmd_refusal
from tfplan.apply.mode import execution_mode
from tests.apply import helpers
from tests.apply.spmd.test_engine import BATCH, STEPS, wrapped_and_reference


def _plan(model, dp, m=1, batch_norm="global"):
    plan = helpers.tp_plan(model, [helpers.cpus(*range(dp))], dp=dp, num_microbatches=m,
                           global_batch=BATCH)
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  batch_norm=batch_norm))


def test_statistics_over_the_replicas_train_like_one_device():
    module = helpers.load_model_file("tiny_resnet_bn")
    model = module.build_model()
    wrapped = apply.wrap(module.build_model, _plan(model, 4))
    assert isinstance(wrapped, SpmdModel)
    norms = [layer for m in wrapped.device_models for layer in m.layers
             if isinstance(layer, GroupBatchNormalization)]
    assert len(norms) == 4 * 4 and {n.group.size for n in norms} == {4}
    reference = module.build_model()
    reference.set_weights(wrapped.get_weights())
    for target in (wrapped, reference):
        target.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):  # moving stats too
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), reference.predict_on_batch(x),
                               rtol=1e-4, atol=1e-5)


def test_local_statistics_are_each_replicas_and_the_moving_ones_their_mean():
    """``local`` (one micro-batch): each replica normalises with its own rows' statistics,
    and the moving statistics move once per step by the replicas' mean -- the older
    engine's rule (MirroredStrategy replicas, apply.batch_stats), which it equals: losses,
    weights and moving statistics; every copy keeps one value; the audit counts the one
    all-reduce of the moving statistics per layer that planner.traffic prices."""
    import keras
    import pytest

    from tfplan.apply.audit import audit_step
    from tfplan.apply.cloning import to_functional
    from tfplan.apply.data_parallel import wrap_data_parallel
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    module = helpers.load_model_file("tiny_resnet_bn")
    keras.utils.set_random_seed(0)
    model = module.build_model()
    plan = _plan(model, 4, batch_norm="local")
    with pytest.warns(UserWarning, match="per replica and micro-batch"):
        wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    older = wrap_data_parallel(to_functional(model), plan.stages[0].devices,
                               plan_name=plan.name, num_microbatches=1)
    older.set_batch_norm("local")
    for target in (wrapped, older):
        target.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    x, _ = module.sample_batch(BATCH)
    batches = [(b[0] + 0.3 * i, b[1])  # each step's mean shifted: per-part statistics show
               for i, b in enumerate(helpers.batches_of(module, STEPS, BATCH))]
    losses = helpers.step_losses(wrapped, batches)
    helpers.assert_losses_match(losses, helpers.step_losses(older, batches))
    for got, want in zip(wrapped.get_weights(), older.get_weights()):  # moving stats too
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    one = module.build_model()
    one.set_weights(model.get_weights())
    one.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    assert abs(losses[0] - float(one.train_on_batch(*batches[0]))) > 1e-4  # not one device's
    for i in range(len(model.weights)):  # one value in every copy
        values = [m.weights[i].numpy() for m in wrapped.device_models]
        for v in values[1:]:
            np.testing.assert_array_equal(v, values[0])
    audit = audit_step(wrapped, x, batches[0][1], plan=plan)
    priced = dict(plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH),
                                  plan))
    for device, kinds in audit.by_device().items():
        assert kinds["dp"] == pytest.approx(dict(priced[device])["dp"], rel=0.10), device


def _local_by_hand(module, weights, batches, parts):
    """One device training under ``local`` by hand: each step's batch cut into ``parts``
    equal parts (replica-major, then micro-batch), each a plain Keras training forward on
    its rows (its own statistics, from the step's moving statistics); loss and gradient
    their mean; the moving statistics the mean of the parts' Keras updates."""
    import keras
    import tensorflow as tf

    model = module.build_model()
    model.set_weights(weights)
    optimizer = helpers.fresh_optimizer(module)
    loss_of = keras.losses.SparseCategoricalCrossentropy()
    moving = model.non_trainable_variables
    losses = []
    for x, y in batches:
        start = [v.numpy() for v in moving]
        total, grads, after = 0.0, None, []
        for xs, ys in zip(np.split(x, parts), np.split(y, parts)):
            for v, value in zip(moving, start):
                v.assign(value)
            with tf.GradientTape() as tape:
                loss = loss_of(ys, model(xs, training=True)) / parts
            g = tape.gradient(loss, model.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            total += float(loss)
            after.append([v.numpy() for v in moving])
        for i, v in enumerate(moving):
            v.assign(np.mean([a[i] for a in after], axis=0))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(total)
    return losses, model.get_weights()


@pytest.mark.parametrize("dp,m", [(1, 2), (2, 2)])
def test_local_statistics_over_micro_batches_are_each_parts(dp, m):
    """``local`` with micro-batches: each of the dp x m parts normalised by its own rows,
    the moving statistics moved once per step by the parts' mean (recorded, then one
    update: apply.spmd.batch_norm.moving_statistics) -- equal to that rule by hand."""
    module = helpers.load_model_file("tiny_resnet_bn")
    model = module.build_model()
    with pytest.warns(UserWarning, match="per replica and micro-batch"):
        wrapped = apply.wrap(module.build_model, _plan(model, dp, m, batch_norm="local"))
    assert isinstance(wrapped, SpmdModel) and wrapped.run_description.num_microbatches == m
    weights = wrapped.get_weights()
    wrapped.compile(optimizer=helpers.fresh_optimizer(module), loss=module.loss)
    batches = [(b[0] + 0.3 * i, b[1])  # each step's mean shifted: per-part statistics show
               for i, b in enumerate(helpers.batches_of(module, 3, BATCH))]
    want_losses, want_weights = _local_by_hand(module, weights, batches, dp * m)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches), want_losses)
    for got, want in zip(wrapped.get_weights(), want_weights):  # moving statistics too
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_global_statistics_join_the_micro_batches():
    """``global`` with micro-batches: each replica's micro-batches run as one (the barrier
    planner.batch_stats prices), said in the run description; equal to one device
    (tests/apply/test_batch_stats.py trains the pipeline shapes)."""
    module = helpers.load_model_file("tiny_resnet_bn")
    model = module.build_model()
    plan = _plan(model, 2, m=2)
    assert spmd_refusal(plan, execution_mode(plan), model) == ""
    wrapped, reference = wrapped_and_reference(module, plan)
    run = wrapped.run_description
    assert (run.num_microbatches, run.joined_microbatches, run.parts) == (1, 2, 2)
    assert run.to_dict()["joined_microbatches"] == 2
    batches = helpers.batches_of(module, 3, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
