"""Activation recomputation (apply.recompute) in single-device and pipeline plans.

What is asserted: the recomputed layers' forward ops really are in the gradient
graph (one extra forward MatMul per recomputed Dense layer, created by the
gradient function, on the layer's own device), the losses equal those without
recomputation (1e-6 relative), "selective" recomputes the attention core only (the
two Einsums and the Softmax of each attention layer, once per tensor rank or replica on
its device, no projection; one device, tp = 2 with heads split, dp = 2; 10 steps equal
to one device within 1e-4; GroupQueryAttention in a nested model too), layers that hold
state are kept (with a warning; attention with dropout under "selective"), and no "not
applied" warning remains for the placed modes.
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
from tests.apply.helpers import (GLOBAL_BATCH, STEPS, assert_losses_match, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan,
                                 reference_losses, step_losses, tp_plan)

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


# --- "selective": the attention core alone (Korthikanti et al., 2022, Sec. 5) -------------

CORE_RECOMPUTED = re.compile(r"(^|/)gradients(_\d+)?/.*IdentityN(_\d+)?_grad/")
CORE_TYPES = ("Einsum", "Softmax", "MatMul", "BatchMatMulV2")
SELECTIVE_STEPS = 10


def rerun_ops(ops):
    """Ops of ``CORE_TYPES`` a recompute gradient function runs again (any replica)."""
    return [op for op in ops if op.type in CORE_TYPES and CORE_RECOMPUTED.search(op.name)
            and "gradient_tape" not in op.name]


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
    from tests.apply.test_data_parallel import forward_ops_after_gradients, train_step_graph

    def rerun_in(model):
        if case == "dp2":  # MirroredStrategy's step differentiates with the tape, whose
            # recomputation has no layer scope: found by depending on the backward pass
            return forward_ops_after_gradients(train_step_graph(model, x, y), CORE_TYPES)
        return rerun_ops(train_step_ops(model, x, y))

    module, model = base_model("tiny_transformer")
    plan = selective_plan(model, case)
    assert recomputed_layers(plan, model) == (("attention",), ())
    w = wrapped(model, plan, module)
    assert w.recompute_layers == frozenset()  # no layer is recomputed whole
    assert w.recompute_cores == frozenset({"attention"})
    x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
    rerun = rerun_in(w)
    devices = ["/device:CPU:1"] if case == "single_device" else ["/device:CPU:1",
                                                                  "/device:CPU:2"]
    by_device = {d: sorted(op.type for op in rerun
                           if tf.DeviceSpec.from_string(op.device).device_index
                           == tf.DeviceSpec.from_string(d).device_index) for d in devices}
    assert by_device == {d: ["Einsum", "Einsum", "Softmax"] for d in devices}, [
        (op.type, op.name, op.device) for op in rerun]
    assert len(rerun) == 3 * len(devices)
    if case != "dp2":
        assert all("/attention" in op.name for op in rerun)
    # without recomputation nothing is re-run
    assert rerun_in(wrapped(model, with_recompute(plan, "none"), module)) == []
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
    rerun = rerun_ops(train_step_ops(sel, *batches[0]))
    assert sorted(op.type for op in rerun) == ["Einsum", "Einsum", "Softmax"], [
        op.name for op in rerun]
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
    assert w.recompute_cores == frozenset({"kept"})
