"""Recomputation on the SPMD engine: the plan's recomputed layers (whole under "full", their
attention cores under "selective") run under ``tf.recompute_grad`` in every device's copy.

Asserted: the recomputed forward ops are in each device's gradient graph, on that device
(one MatMul per recomputed Dense shard and device; under "selective" the attention core's
Einsums and Softmax, no projection), training equals one device's (1e-4), and under
tensor parallelism the recomputed forward all-reduces are sent and priced (audit within
10% of ``planner.traffic``).
"""
from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from tfplan.apply.audit import audit_step
from tfplan.planner.traffic import plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tests.apply.spmd.test_engine import BATCH, STEPS, _wrapped
from tests.apply.test_recompute import TINY_MLP_DENSE, train_step_ops


def _per_device(wrapped, module, types):
    """{device index: ops of ``types``} in the traced train step."""
    out: dict[int, int] = {}
    for op in train_step_ops(wrapped, *module.sample_batch(BATCH)):
        if op.type in types:
            index = tf.DeviceSpec.from_string(op.device).device_index
            out[index] = out.get(index, 0) + 1
    return out


def _extra(case, name, recompute, types):
    """(module, wrapped, reference, the ops of ``types`` each device runs more than
    without recomputation: the forward ops recompute_grad re-runs in the backward)."""
    module, _, wrapped, reference = _wrapped(name, case, recompute=recompute)
    _, _, plain, _ = _wrapped(name, case)
    more, fewer = _per_device(wrapped, module, types), _per_device(plain, module, types)
    return module, wrapped, reference, {d: more.get(d, 0) - fewer.get(d, 0) for d in more}


def test_full_recompute_reruns_every_devices_layers_on_it_and_trains_like_one_device():
    module, wrapped, reference, extra = _extra("dp2xtp2", "tiny_mlp", "full", ("MatMul",))
    run = wrapped.run_description
    assert run.recompute == "full" and set(run.recomputed) == set(TINY_MLP_DENSE)
    # every device re-runs its shard of each Dense layer once (one micro-batch), on it
    assert extra == {i: len(TINY_MLP_DENSE) for i in range(4)}  # and no input gradient
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))


def test_selective_recompute_reruns_the_attention_core_only():
    module, wrapped, reference, extra = _extra("dp2xtp2", "tiny_transformer", "selective",
                                               ("Einsum", "Softmax", "MatMul"))
    assert wrapped.run_description.recomputed == ("attention",)
    # QK^T, the softmax and scores x V again on every device; no projection
    assert extra == {i: 3 for i in range(4)}
    batches = helpers.batches_of(module, STEPS, BATCH)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))


def test_full_recompute_under_tensor_parallelism_sends_the_forward_all_reduce_again():
    module, plan, wrapped, _ = _wrapped("tiny_mlp", "tp2", recompute="full")
    x, y = module.sample_batch(BATCH)
    audit = audit_step(wrapped, x, y, plan=plan)
    keras.utils.set_random_seed(0)
    priced = dict(plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH), plan))
    for device in plan.devices:  # priced with the forward all-reduces twice
        tp = audit.by_device()[device]["tp"]
        assert tp == pytest.approx(dict(priced[device])["tp"], rel=0.10), device
