"""Activation recomputation (apply.recompute) in single-device and pipeline plans.

What is asserted: the recomputed layers' forward ops really are in the gradient
graph (one extra forward MatMul per recomputed Dense layer, created by the
gradient function, on the layer's own device), the losses equal those without
recomputation (1e-6 relative), "selective" recomputes attention layers only,
layers that hold state are kept (with a warning), and no "not applied" warning
remains for the placed modes.
"""
from __future__ import annotations

import dataclasses
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.recompute import recomputed_layers
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, base_model, batches_of, cpus,
                                 fresh_optimizer, make_plan, step_losses)

TINY_MLP_DENSE = ("dense_in", "hidden", "narrow", "head")


def with_recompute(plan, recompute):
    return dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  recompute=recompute))


def wrapped(model, plan, module=None, loss="mse"):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "recompute ... not applied" warning
        w = apply.wrap(model, plan)
    w.compile(optimizer=fresh_optimizer(module) if module else keras.optimizers.Adam(1e-2),
              loss=module.loss if module else loss)
    return w


def train_step_ops(model, x, y):
    """The ops of the model's traced train step (forward, gradients, update)."""
    spec = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    return graph.get_operations()


RECOMPUTED = re.compile(r"^gradients(_\d+)?/.*IdentityN(_\d+)?_grad/")


def recomputed_ops(ops, types=("MatMul",)):
    """Forward ops re-run by a recompute gradient function: made inside the gradient of the
    recompute_grad's IdentityN, not by the tape that differentiates them
    (``gradients/.../IdentityN_3_grad/head_1/MatMul``)."""
    return [op for op in ops if op.type in types and RECOMPUTED.match(op.name)
            and "gradient_tape" not in op.name]


@pytest.mark.parametrize("stages,m", [([cpus(0)], 1), ([cpus(1), cpus(3)], 2)],
                         ids=["single_device", "pipeline"])
def test_full_recompute_reruns_each_layer_forward_with_the_same_losses(stages, m):
    module, model = base_model("tiny_mlp")
    plan = make_plan(model, stages, num_microbatches=m, global_batch=GLOBAL_BATCH)
    batches = batches_of(module, STEPS, GLOBAL_BATCH)
    plain = wrapped(model, plan, module)
    full = wrapped(model, with_recompute(plan, "full"), module)
    assert plain.recompute_layers == frozenset()
    assert full.recompute_layers == frozenset(TINY_MLP_DENSE)

    x, y = batches[0]
    plain_ops, full_ops = train_step_ops(plain, x, y), train_step_ops(full, x, y)
    n_plain = sum(op.type == "MatMul" for op in plain_ops)
    n_full = sum(op.type == "MatMul" for op in full_ops)
    # one forward MatMul per Dense layer per micro-batch is run again in the backward pass
    assert n_full - n_plain == len(TINY_MLP_DENSE) * m
    assert recomputed_ops(plain_ops) == []
    recomputed = recomputed_ops(full_ops)
    assert len(recomputed) == len(TINY_MLP_DENSE) * m
    device_of = plan.device_of_layer()
    for layer in TINY_MLP_DENSE:
        mine = [op for op in recomputed if f"/{layer}_" in op.name or f"/{layer}/" in op.name]
        assert len(mine) == m, (layer, [op.name for op in recomputed])
        assert {tf.DeviceSpec.from_string(op.device).device_index for op in mine} == {
            tf.DeviceSpec.from_string(device_of[layer]).device_index}

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
    x, y = batches[0]
    sel_ops = train_step_ops(sel, x, y)
    attention = [op for op in recomputed_ops(sel_ops, ("Einsum", "MatMul", "BatchMatMulV2"))
                 if "/attention" in op.name]
    assert attention, "no recomputed attention op in the gradient graph"
    assert recomputed_ops(train_step_ops(plain, x, y), ("Einsum", "MatMul")) == []
    # the Dense layers are not recomputed
    assert [op for op in recomputed_ops(sel_ops) if "/embed" in op.name or "/head" in op.name
            ] == []
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
    assert w.recompute_layers == frozenset({"d1", "d2"})


def test_data_parallel_plans_recompute_through_apply_wrap(recwarn):
    """dp = 2 with recompute="full": apply.wrap hands every layer to the data-parallel
    model's recomputation (tests/apply/test_data_parallel.py counts the recomputed ops),
    says nothing is left unapplied, and the losses equal no recomputation."""
    module, model = base_model("tiny_mlp")
    plan = make_plan(model, [cpus(0, 1)])
    recomputed = apply.wrap(model, with_recompute(plan, "full"))
    assert not [w for w in recwarn if "does not apply" in str(w.message)]
    assert type(recomputed).__name__ == "DataParallelModel"
    assert recomputed.recompute_layers == {"dense_in", "hidden", "narrow", "head"}
    recomputed.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    plain = wrapped(model, plan, module)
    batches = batches_of(module, 3, GLOBAL_BATCH)
    np.testing.assert_allclose(step_losses(recomputed, batches), step_losses(plain, batches),
                               rtol=1e-6)


def test_recompute_in_an_eager_train_step_gives_the_same_losses():
    """run_eagerly=True: the placed model's tape path (apply.pipeline) recomputes too."""
    module, model = base_model("tiny_mlp")
    plan = with_recompute(make_plan(model, [cpus(1), cpus(3)], num_microbatches=2), "full")
    batches = batches_of(module, 2, GLOBAL_BATCH)
    graph, eager = wrapped(model, plan, module), apply.wrap(model, plan)
    eager.compile(optimizer=fresh_optimizer(module), loss=module.loss, run_eagerly=True)
    np.testing.assert_allclose(step_losses(eager, batches), step_losses(graph, batches),
                               rtol=1e-6)
