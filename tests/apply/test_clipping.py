"""``global_clipnorm`` in the modes that update several copies of a weight
(``apply.clipping``): the wrapped model clips as one device does, so the losses match.

The tiny MLP with ``SGD(momentum=0.9, global_clipnorm=c)``, ``c`` a quarter of the first step's
gradient norm (so every step clips: checked against the unclipped losses), trained
for STEPS steps as one device and under hand-made plans on the logical CPUs of
tests/conftest.py: dp2 x pp2 and dp2 x tp2 (the replicated machinery,
``apply.tensor_parallel``), dp=2 with ZeRO-1 (``apply.zero``) and dp=4
(MirroredStrategy, ``apply.data_parallel``). Without ``apply.clipping`` the replicated
modes clip with a norm sqrt(dp) too large and MirroredStrategy clips each replica's
part before summing (Keras 3): loss differences of up to 12% here, far above 1e-4.
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply, compat
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, make_plan, step_losses)
from tests.apply.test_zero import MLP_SPLITS

STEPS = 6
LEARNING_RATE = 0.1  # SGD: Adam would hide the clipping (its steps ignore scale)

CASES = {  # name: (stage devices, micro-batches, dp, tp splits, ZeRO-1)
    "dp2xpp2": ([cpus(0, 1), cpus(2, 3)], 2, 2, (), False),
    "dp2xtp2": ([cpus(4, 5, 6, 7)], 1, 2, MLP_SPLITS, False),
    "dp2 zero1": ([cpus(0, 1)], 1, 2, (), True),
    "dp4": ([cpus(0, 1, 2, 3)], 1, 4, (), False),
}
_CACHE: dict = {}


def _clip_norm() -> float:
    """A quarter of the MLP's first-step gradient norm (single device)."""
    if "clip" not in _CACHE:
        module, model = base_model("tiny_mlp")
        x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.get(module.loss)(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        _CACHE["clip"] = 0.25 * float(tf.linalg.global_norm(grads))
    return _CACHE["clip"]


def _optimizer(clip: float | None) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=0.9,
                                global_clipnorm=clip)


def _single_device(clip: float | None) -> list[float]:
    key = ("reference", clip)
    if key not in _CACHE:
        module, model = base_model("tiny_mlp")
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
        copy.compile(optimizer=_optimizer(clip), loss=module.loss)
        _CACHE[key] = step_losses(copy, batches_of(module, STEPS, GLOBAL_BATCH))
    return _CACHE[key]


def test_clipping_is_active():
    """The test below could fail: clipping changes the single-device losses."""
    clipped, free = _single_device(_clip_norm()), _single_device(None)
    assert not np.allclose(clipped[1:], free[1:], rtol=1e-3)


@pytest.mark.parametrize("case", sorted(CASES))
def test_global_clipnorm_matches_one_device(case):
    stage_devices, m, dp, splits, zero = CASES[case]
    module, model = base_model("tiny_mlp")
    plan = make_plan(model, stage_devices, num_microbatches=m)
    tp = len(stage_devices[0]) // dp
    strategy = dataclasses.replace(plan.strategy, dp=dp, tp=tp, zero_stage=int(zero),
                                   microbatch_size=GLOBAL_BATCH // (dp * m))
    plan = dataclasses.replace(plan, strategy=strategy, tp_splits=splits,
                               name=f"clip {case}")
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=_optimizer(_clip_norm()), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH))
    assert_losses_match(losses, _single_device(_clip_norm()))
    # the optimizer's own clipping is back on, and it sums across replicas again
    assert wrapped.optimizer.global_clipnorm == pytest.approx(_clip_norm())
    assert compat.ALL_REDUCE_SUM_GRADIENTS not in vars(wrapped.optimizer)
