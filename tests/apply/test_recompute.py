"""Activation recomputation (apply.recompute) through ``apply.wrap`` of a built model, on the
SPMD engine (apply.spmd): the plan's recomputed layers (whole under "full", their attention
cores under "selective") run under ``tf.recompute_grad`` in every device's copy.

What is asserted: the recomputed layers' forward ops really are in the gradient graph
(each device's traced train step runs one more forward MatMul per recomputed Dense layer
and micro-batch than without recomputation, on the layer's own device), the losses equal
those without recomputation (1e-6 relative), "selective" recomputes the attention core
only (the two Einsums and the Softmax of each attention layer, once per tensor rank or
replica on its device, no projection; one device, tp = 2 with heads split, dp = 2; 10
steps equal to one device within 1e-4; GroupQueryAttention in a nested model too), layers
that hold state are kept (with a warning; attention with dropout under "selective"), and
no "not applied" warning is given.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.recompute import recomputed_layers
from tfplan.apply.spmd import SpmdModel
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, assert_losses_match, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan,
                                 reference_losses, step_losses, tp_plan)

TINY_MLP_DENSE = ("dense_in", "hidden", "narrow", "head")
CORE_TYPES = ("Einsum", "Softmax", "MatMul", "BatchMatMulV2")
SELECTIVE_STEPS = 10


def with_recompute(plan, recompute):
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  recompute=recompute))


def wrapped(model, plan, module=None, loss="mse"):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "recompute ... not applied" warning
        w = apply.wrap(model, plan)
    assert isinstance(w, SpmdModel)
    w.compile(optimizer=fresh_optimizer(module) if module else keras.optimizers.Adam(1e-2),
              loss=module.loss if module else loss)
    return w


def train_step_ops(model, x, y):
    """The ops of the model's traced train step (forward, gradients, update)."""
    spec = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    return graph.get_operations()


def _counts(model, x, y, types):
    """{(device index, op type): ops} of ``types`` in the model's traced train step."""
    return collections.Counter((tf.DeviceSpec.from_string(op.device).device_index, op.type)
                               for op in train_step_ops(model, x, y) if op.type in types)


def extra_ops(recomputed, plain, x, y, types=("MatMul",)):
    """{(device index, op type): ops} the recomputing model's step runs more than the plain
    one's (the forward ops ``tf.recompute_grad`` runs again in the backward pass); an op
    type a device runs fewer of is an error."""
    more, fewer = _counts(recomputed, x, y, types), _counts(plain, x, y, types)
    assert not fewer - more, fewer - more
    return dict(more - fewer)


def _index(device: str) -> int:
    return tf.DeviceSpec.from_string(device).device_index


@pytest.mark.parametrize("stages,m", [([cpus(0)], 1), ([cpus(1), cpus(3)], 2)],
                         ids=["single_device", "pipeline"])
def test_full_recompute_reruns_each_layer_forward_with_the_same_losses(stages, m):
    module, model = base_model("tiny_mlp")
    plan = make_plan(model, stages, num_microbatches=m, global_batch=GLOBAL_BATCH)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    plain = wrapped(model, plan, module)
    full = wrapped(model, with_recompute(plan, "full"), module)
    assert plain.run_description.recomputed == ()
    assert set(full.run_description.recomputed) == set(TINY_MLP_DENSE)
    # one forward MatMul per Dense layer per micro-batch is run again, on the layer's device
    want = collections.Counter()
    for layer in TINY_MLP_DENSE:
        want[(_index(plan.device_of_layer()[layer]), "MatMul")] += m
    assert extra_ops(full, plain, *batches[0]) == dict(want)
    np.testing.assert_allclose(step_losses(full, batches), step_losses(plain, batches),
                               rtol=1e-6)


def attention_model():
    inputs = keras.Input(shape=(4, 8), name="tokens")
    x = keras.layers.Dense(8, name="embed")(inputs)
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")(x, x)
    x = keras.layers.Flatten(name="flatten")(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_attention")


def test_selective_recompute_reruns_attention_only():
    keras.utils.set_random_seed(0)
    model = attention_model()
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 4, 8)).astype("float32"),
                rng.normal(size=(8, 2)).astype("float32")) for _ in range(3)]
    plan = make_plan(model, [cpus(0), cpus(2)], num_microbatches=2, global_batch=8)
    selective = with_recompute(plan, "selective")
    assert recomputed_layers(selective, model) == (("attention",), ())
    plain, sel = wrapped(model, plan), wrapped(model, selective)
    # the attention core (QK^T, softmax, scores x V) again per micro-batch on its stage's
    # device; no projection, no Dense layer
    attention = _index(plan.device_of_layer()["attention"])
    assert extra_ops(sel, plain, *batches[0], CORE_TYPES) == {
        (attention, "Einsum"): 4, (attention, "Softmax"): 2}
    np.testing.assert_allclose(step_losses(sel, batches), step_losses(plain, batches),
                               rtol=1e-6)


def test_layers_with_state_keep_their_activations_and_say_so():
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(6,))
    x = keras.layers.Dense(8, name="d1")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="d2")(x), name="stateful")
    plan = with_recompute(make_plan(model, [cpus(0)], global_batch=8), "full")
    assert recomputed_layers(plan, model) == (("d1", "d2"), ("bn", "drop"))
    with pytest.warns(UserWarning, match=r"\['bn', 'drop'\].*keep their activations"):
        w = apply.wrap(model, plan)
    assert w.run_description.recomputed == ("d1", "d2")


def test_data_parallel_plans_recompute_through_apply_wrap(recwarn):
    """dp = 2 with recompute="full": every replica's copy re-runs its layers' forward on its
    own device, nothing is said to be left unapplied, and the losses equal no
    recomputation."""
    module, model = base_model("tiny_mlp")
    plan = make_plan(model, [cpus(0, 1)])
    recomputed = apply.wrap(model, with_recompute(plan, "full"))
    assert not [w for w in recwarn if "does not apply" in str(w.message)]
    assert isinstance(recomputed, SpmdModel)
    assert set(recomputed.run_description.recomputed) == set(TINY_MLP_DENSE)
    recomputed.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    plain = wrapped(model, plan, module)
    batches = batches_of(module, 3, GLOBAL_BATCH)
    assert extra_ops(recomputed, plain, *batches[0]) == {
        (d, "MatMul"): len(TINY_MLP_DENSE) for d in (0, 1)}
    np.testing.assert_allclose(step_losses(recomputed, batches), step_losses(plain, batches),
                               rtol=1e-6)


def test_an_eager_train_step_is_refused_with_the_fix():
    """run_eagerly=True: the SPMD engine's step is one traced program (its collectives in
    one order per device), so it says so before any step runs."""
    from tfplan.core.errors import PlannerError

    module, model = base_model("tiny_mlp")
    plan = with_recompute(make_plan(model, [cpus(1), cpus(3)], num_microbatches=2), "full")
    eager = apply.wrap(model, plan)
    with pytest.raises(PlannerError, match=r"run_eagerly=True.*run_eagerly=False"):
        eager.compile(optimizer=fresh_optimizer(module), loss=module.loss, run_eagerly=True)
    with pytest.raises(PlannerError, match="cannot run eagerly"):
        eager.run_eagerly = True
    assert eager.run_eagerly is False


# --- "selective": the attention core alone (Korthikanti et al., 2022, Sec. 5) -------------

def selective_plan(model, case):
    if case == "single_device":
        plan = make_plan(model, [cpus(1)])
    elif case == "tp2":  # the attention's heads split over two devices
        plan = tp_plan(model, [cpus(1, 2)], (("attention", "heads"),))
    else:  # dp2: MirroredStrategy replicas
        plan = make_plan(model, [cpus(1, 2)])
    return with_recompute(plan, "selective")


@pytest.mark.parametrize("case", ["single_device", "tp2", "dp2"])
def test_selective_recompute_reruns_only_the_attention_core(case):
    """The two Einsums (QK^T, scores x V) and the Softmax of the attention core are re-run
    in the backward pass, once per tensor rank or replica, on that rank's device; no
    projection (Q/K/V/output), no other layer; 10 steps give one device's losses."""
    module, model = base_model("tiny_transformer")
    plan = selective_plan(model, case)
    assert recomputed_layers(plan, model) == (("attention",), ())
    w = wrapped(model, plan, module)
    assert w.run_description.recompute == "selective"
    assert w.run_description.recomputed == ("attention",)
    x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
    devices = [1] if case == "single_device" else [1, 2]
    plain = wrapped(model, with_recompute(plan, "none"), module)
    assert extra_ops(w, plain, x, y, CORE_TYPES) == {
        **{(d, "Einsum"): 2 for d in devices}, **{(d, "Softmax"): 1 for d in devices}}
    assert_losses_match(step_losses(w, batches_of(module, SELECTIVE_STEPS, GLOBAL_BATCH)),
                        reference_losses("tiny_transformer", SELECTIVE_STEPS))


def test_selective_recompute_of_grouped_query_attention_and_a_nested_model():
    keras.utils.set_random_seed(0)
    inner_in = keras.Input(shape=(4, 8))
    inner = keras.Model(inner_in, keras.layers.GroupQueryAttention(
        head_dim=4, num_query_heads=4, num_key_value_heads=2, name="gqa")(inner_in, inner_in),
        name="block")
    inputs = keras.Input(shape=(4, 8), name="tokens")
    x = keras.layers.Dense(8, name="embed")(inputs)
    x = inner(x)
    x = keras.layers.Flatten(name="flatten")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x), name="nested_gqa")
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 4, 8)).astype("float32"),
                rng.normal(size=(8, 2)).astype("float32")) for _ in range(SELECTIVE_STEPS)]
    plan = make_plan(model, [cpus(1)], global_batch=8)
    selective = with_recompute(plan, "selective")
    assert recomputed_layers(selective, model) == (("block",), ())
    plain, sel = wrapped(model, plan), wrapped(model, selective)
    assert extra_ops(sel, plain, *batches[0], CORE_TYPES) == {(1, "Einsum"): 2,
                                                              (1, "Softmax"): 1}
    np.testing.assert_allclose(step_losses(sel, batches), step_losses(plain, batches),
                               rtol=1e-4)


def test_selective_keeps_attention_with_dropout_and_says_so():
    """Attention dropout draws its mask from the layer's seed generator, so a recomputed
    core would draw another: such a layer keeps its activations (a warning says so)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(4, 8))
    x = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="dropped")(inputs, inputs)
    x = keras.layers.MultiHeadAttention(2, 4, name="kept")(x, x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x), name="two_attentions")
    plan = with_recompute(make_plan(model, [cpus(1)], global_batch=8), "selective")
    assert recomputed_layers(plan, model) == (("kept",), ("dropped",))
    with pytest.warns(UserWarning, match=r"\['dropped'\].*keep their activations"):
        w = apply.wrap(model, plan)
    assert w.run_description.recomputed == ("kept",)
