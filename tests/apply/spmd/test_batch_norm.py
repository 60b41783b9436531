"""BatchNormalization on the SPMD engine (apply.spmd.batch_norm): under data parallelism
each layer's training statistics are the whole batch's, summed over the data-parallel
group, so training, the moving statistics and inference equal one device's; plans whose
statistics the engine does not sum (micro-batches, "local") go to the older engine."""
from __future__ import annotations

import dataclasses

import numpy as np

from tfplan import apply
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.batch_norm import GroupBatchNormalization
from tfplan.apply.wrap import spmd_refusal
from tfplan.apply.mode import execution_mode
from tests.apply import helpers
from tests.apply.spmd.test_engine import BATCH, STEPS


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


def test_statistics_the_engine_does_not_sum_go_to_the_older_engine():
    module = helpers.load_model_file("tiny_resnet_bn")
    model = module.build_model()
    for plan, reason in ((_plan(model, 2, m=2), "micro-batches"),
                         (_plan(model, 2, batch_norm="local"), "local")):
        assert reason in spmd_refusal(plan, execution_mode(plan), model)
        assert not isinstance(apply.wrap(module.build_model, plan), SpmdModel)
