"""ZeRO-1, 2 and 3 on the SPMD engine (apply.spmd.zero, apply.spmd.zero3): each
data-parallel rank keeps 1/dp of every weight's optimizer state, receives its shard of the
summed gradients by a reduce-scatter, and all-gathers the updated shards (ZeRO-3: trains the
shards, gathering each layer's weights for its forward and its backward); training equals
one device's.

Cases as in test_engine (seed 0, per-step losses within 1e-4 of one device's, float32),
with the transformer's Embedding (sparse gradients, repeated ids: Adam's rows) among them.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

from tfplan.apply.audit import audit_step
from tfplan.core.errors import PlannerError
from tfplan.planner.traffic import plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tests.apply.spmd.test_engine import BATCH, STEPS, _device, _wrapped


def _assert_state_on_the_shards_devices(wrapped) -> None:
    """Each device's optimizer slots are its shards' (1/dp of its copy's weights) and
    live on it; no copy's weight has a slot."""
    run = wrapped.run_description
    opt = wrapped.optimizer
    shards = wrapped._zero.shards
    for q, replica in enumerate(run.replicas):
        for t, device in enumerate(replica):
            copy = wrapped._copies.models[q][t]
            own = sum(int(np.prod(v.shape)) for v in copy.trainable_variables)
            held = sum(int(np.prod(s.shape)) for s in shards[q][t])
            assert held <= own / run.dp + len(shards[q][t]) * max(
                int(np.prod(v.shape[1:])) for v in copy.trainable_variables)
            for s in shards[q][t]:
                i = opt._get_variable_index(s)
                for slot in (opt._momentums[i], opt._velocities[i]):
                    assert _device(slot.value.device) == _device(device), (slot.path, device)
    assert len(opt._momentums) == len(wrapped._zero.variables)


@pytest.mark.parametrize("name, case, zero", [
    ("tiny_mlp", "dp4", 1), ("tiny_mlp", "dp2-m2", 2),
    ("tiny_transformer", "dp2xtp2", 1), ("tiny_transformer", "dp2-m2", 2),
    ("tiny_transformer", "dp2xtp2", 3), ("tiny_mlp", "dp2-m2", 3)])
def test_zero_trains_like_one_device_with_the_state_sharded(name, case, zero):
    module, _, wrapped, reference = _wrapped(name, case, zero=zero)
    assert wrapped.run_description.zero_stage == zero
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)
    _assert_state_on_the_shards_devices(wrapped)


@pytest.mark.parametrize("name, case, zero", [
    ("tiny_mlp", "dp4", 1), ("tiny_mlp", "dp2-m2", 2), ("tiny_mlp", "dp2-m2", 3),
    # an Embedding's rows and table (closed forms: tests/planner/test_traffic.py)
    pytest.param("tiny_transformer", "dp2-m2", 3, marks=pytest.mark.slow)])
def test_zero_sends_what_the_plan_prices(name, case, zero):
    module, plan, wrapped, _ = _wrapped(name, case, zero=zero)
    x, y = module.sample_batch(BATCH)
    audit = audit_step(wrapped, x, y, plan=plan)
    keras.utils.set_random_seed(0)
    priced = dict(plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH), plan))
    measured = audit.by_device()
    assert not audit.unsized
    for device in plan.devices:
        for kind in ("dp", "zero"):
            assert measured[device][kind] == pytest.approx(dict(priced[device])[kind],
                                                           rel=0.10), (device, kind)
    totals = [audit.total(d) - measured[d]["input"] for d in plan.devices]
    assert max(totals) <= 1.25 * sum(totals) / len(totals)


def test_zero3_gathers_each_layers_weights_from_the_shards_and_refuses_layer_state():
    module, _, wrapped, reference = _wrapped("tiny_mlp", "dp4", zero=3)
    x, y = module.sample_batch(BATCH)
    wrapped.train_on_batch(x, y)
    reference.train_on_batch(x, y)
    # the shards are the weights trained: each copy's own weights hold nothing
    for copy in wrapped.device_models:
        assert all(tuple(v.value.shape) == (0,) for v in copy.trainable_variables)
    got = wrapped.get_weights()  # joined from the shards
    for a, b in zip(got, reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    wrapped.set_weights(reference.get_weights())  # written into the shards
    np.testing.assert_allclose(wrapped.predict_on_batch(x), reference.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(PlannerError, match="non-trainable state.*--zero-stage 2"):
        _wrapped("tiny_resnet_bn", "dp4", zero=3)


def test_clipping_weight_decay_exclusions_and_loss_scaling_are_one_devices():
    def adamw():
        opt = keras.optimizers.AdamW(1e-2, weight_decay=0.1, global_clipnorm=0.05)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt

    module, _, wrapped, reference = _wrapped("tiny_transformer", "dp2xtp2", zero=1,
                                             optimizer=adamw)
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    # clipnorm leaves an Embedding's sparse gradient sparse, as Keras' _clip_by_norm does
    # (its rows scaled; densified, Adam's update would differ: 4% by the second step)
    module, _, wrapped, reference = _wrapped(
        "tiny_transformer", "dp2-m2", zero=2,
        optimizer=lambda: keras.optimizers.Adam(1e-2, clipnorm=0.1))
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    module, _, wrapped, reference = _wrapped(
        "tiny_mlp", "dp4", zero=2,
        optimizer=lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2, clipnorm=0.1)))
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches := helpers.batches_of(
        module, STEPS, BATCH)), helpers.step_losses(reference, batches))


def test_an_optimizer_that_reads_whole_weights_is_refused_with_the_fix():
    with pytest.raises(PlannerError, match=r"Lamb.*zero_stage=0"):
        _wrapped("tiny_mlp", "dp4", zero=1, optimizer=lambda: keras.optimizers.Lamb(1e-2))
