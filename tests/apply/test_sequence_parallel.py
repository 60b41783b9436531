"""Sequence parallelism (apply.sequence_parallel, Korthikanti et al. 2022, Sec. 4.2.2) in
the tensor-parallel engine trains exactly like one device, with every shard on its planned
device and the per-token layers' ops of tensor rank t on rank t's device.

Runs on the 8 logical CPU devices of tests/conftest.py: the tiny transformer
(tests/apply/tiny_transformer.py: LayerNormalization and residual Adds between split
layers) and a tiny Llama-style block (tests/apply/tiny_llama.py: RMS-scaled
LayerNormalization, grouped-query attention, SwiGLU), tp2 alone, with data parallelism
around it and inside pipeline stages.
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.sequence_parallel import SEQUENCE_SHARDS, reduce_scatter, token_wise
from tfplan.apply.tensor_parallel import TensorParallelModel
from tests.apply import helpers
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, step_losses, tp_plan)
from tests.apply.test_tensor_parallel import (_short, assert_placement,
                                              assert_replicas_equal, expected_device)

pytestmark = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")

STEPS_SP = 10

SPLITS = {
    "tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                         ("mlp_down", "row"), ("logits", "column")),
    "tiny_llama": (("embed", "vocab"), ("attention", "heads"), ("mlp_gate", "column"),
                   ("mlp_up", "column"), ("mlp_down", "row"), ("logits", "column")),
}
# the replicated per-token layers that run on sequence pieces
PER_TOKEN = {"tiny_transformer": {"res_1", "ln_attention", "res_2", "ln_mlp"},
             "tiny_llama": {"norm_attention", "res_1", "norm_mlp", "swiglu", "res_2",
                            "norm_out"}}

# name: (model file, devices of each stage (dp x tp per stage), dp)
CASES = {
    "transformer-tp2-sp": ("tiny_transformer", [cpus(2, 3)], 1),
    "llama-tp2-sp": ("tiny_llama", [cpus(0, 1)], 1),
    "transformer-dp2-tp2-sp": ("tiny_transformer", [cpus(4, 5, 6, 7)], 2),
    "llama-dp2-tp2-sp": ("tiny_llama", [cpus(0, 1, 2, 3)], 2),
    "transformer-pp2-tp2-sp": ("tiny_transformer", [cpus(0, 1), cpus(2, 3)], 1),
    "llama-pp2-tp2-sp": ("tiny_llama", [cpus(4, 5), cpus(6, 7)], 1),
}


def sp_plan(model, devices, splits, *, dp=1, sequence_parallel=True, **kwargs):
    plan = tp_plan(model, devices, splits, dp=dp, **kwargs)
    return dataclasses.replace(plan, name=plan.name + " sp", strategy=dataclasses.replace(
        plan.strategy, sequence_parallel=sequence_parallel))


def graph_ops(wrapped, x):
    graph = tf.function(lambda t: wrapped(t)).get_concrete_function(tf.constant(x)).graph
    return graph.get_operations()


def assert_per_token_ops_on_their_ranks(wrapped, plan, x) -> None:
    """Each per-token layer runs once per tensor rank (name scope ``rank_t``), every op of
    rank t's copy on rank t's device; none of them runs whole."""
    ops = graph_ops(wrapped, x)
    tp = plan.strategy.tp
    for name, devices in wrapped.sequence_layers.items():
        for t in range(tp):
            mine = [op for op in ops if f"rank_{t}" in op.name and f"/{name}" in op.name
                    and op.device]
            assert mine, (name, t)
            assert {_short(op.device) for op in mine} == {devices[t]}, (name, t)
        whole = [op for op in ops if f"/{name}" in op.name and "rank_" not in op.name
                 and op.device and op.type not in ("Const", "NoOp")]
        assert not whole, (name, [op.name for op in whole])
    assert not wrapped.sequence_gathered


# each model's tp2 runs by default; dp2 x tp2 (llama) and pp2 x tp2 (transformer) once each,
# the other model's with -m slow
SLOW = {"transformer-dp2-tp2-sp", "llama-pp2-tp2-sp"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_losses_and_placement(case):
    name, devices, dp = CASES[case]
    module, model = base_model(name)
    plan = sp_plan(model, devices, SPLITS[name], dp=dp)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, TensorParallelModel)
    stage_of = {layer: s for s in plan.stages for layer in s.layers}
    for r, replica in enumerate(wrapped.replica_models()):
        assert set(replica.sequence_layers) == PER_TOKEN[name]
        for layer, devices_of in replica.sequence_layers.items():  # replica r's tp ranks
            tp = plan.strategy.tp
            assert devices_of == tuple(stage_of[layer].devices[r * tp:(r + 1) * tp])
    batches = batches_of(module, STEPS_SP, GLOBAL_BATCH)
    x, _ = batches[0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches), helpers.reference_losses(name, STEPS_SP))
    assert_placement(wrapped, plan)
    assert_replicas_equal(wrapped)
    for replica in wrapped.replica_models():
        assert_per_token_ops_on_their_ranks(replica, plan, x[:GLOBAL_BATCH // dp])


def test_collectives_at_the_split_layers():
    """All-gather before column / heads layers (a concatenation on each rank), reduce-scatter
    after row / attention / vocabulary layers (each rank's partial cut on its own device,
    the pieces summed on their rank), no slicing between column and row (SwiGLU's product
    runs on the column pieces)."""
    module, model = base_model("tiny_llama")
    plan = sp_plan(model, [cpus(2, 3)], SPLITS["tiny_llama"])
    wrapped = apply.wrap(model, plan)
    x, _ = module.sample_batch(GLOBAL_BATCH)
    ops = graph_ops(wrapped, x)

    def of(layer, kind):
        return sorted(_short(op.device) for op in ops
                      if f"/{layer}" in op.name and op.type == kind)

    for column in ("mlp_gate", "mlp_up", "logits"):  # gathered on each rank
        assert set(of(column, "ConcatV2")) >= set(cpus(2, 3)), column
    for row in ("mlp_down", "attention", "embed"):  # reduce-scattered
        assert of(row, "SplitV") == cpus(2, 3), row
        assert of(row, "AddN") == cpus(2, 3), row
    assert not of("mlp_down", "StridedSlice")
    # no op reads a whole sequence-sharded tensor (each join of pieces is unused, so
    # TensorFlow prunes it): every per-token activation exists only as its tp pieces
    joins = [op for op in ops if op.name.rsplit("/", 1)[-1].startswith(SEQUENCE_SHARDS)
             and op.type == "ConcatV2"]
    assert len(joins) == 8  # embed, attention, mlp_down + 5 per-token layers (not swiglu)
    assert all(not op.outputs[0].consumers() for op in joins), [
        (op.name, [c.name for c in op.outputs[0].consumers()]) for op in joins]
    assert [_short(op.device) for op in ops if "/swiglu" in op.name and op.type == "Mul"
            ] == cpus(2, 3)


def test_reduce_scatter_is_the_sum_cut_by_sequence():
    rng = np.random.default_rng(0)
    partials = [tf.constant(rng.normal(size=(2, 7, 3)).astype("float32")) for _ in range(3)]
    pieces = reduce_scatter(partials, cpus(0, 1, 2))
    assert [p.shape[1] for p in pieces] == [3, 2, 2]
    assert [_short(p.device) for p in pieces] == cpus(0, 1, 2)
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in pieces], axis=1),
                                  tf.add_n(partials).numpy())


def _mixing_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(6,), dtype="int32")
    x = keras.layers.Embedding(10, 8, name="embed")(ids)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.Dense(16, activation="relu", name="up")(x)
    x = keras.layers.Dense(8, name="down")(x)
    x = keras.layers.Add(name="res")([x, keras.layers.Conv1D(8, 3, padding="same",
                                                             name="conv")(x)])
    x = keras.layers.Flatten(name="flat")(x)  # mixes positions: runs gathered
    x = keras.layers.Dropout(0.0, name="drop")(x)  # [batch, features]: runs whole
    return keras.Model(ids, keras.layers.Dense(3, name="head")(x), name="mixing")


def test_layers_that_mix_positions_run_gathered():
    """A convolution over the sequence and Flatten are not per-token: they read the
    gathered sequence on rank 0; a per-token layer on a [batch, features] input runs whole
    and is listed in ``sequence_gathered``; the function is the one-device one."""
    model = _mixing_model()
    assert token_wise(model.get_layer("flat")) == "" and token_wise(
        model.get_layer("conv")) == ""
    plan = sp_plan(model, [cpus(0, 1)], (("up", "column"), ("down", "row")))
    with pytest.warns(UserWarning, match=r"layers \['conv', 'embed', 'flat', 'head'\] are "
                                         r"not per-token layers.*gathered on their stage's rank 0"):
        wrapped = apply.wrap(model, plan)
    assert set(wrapped.sequence_layers) == {"ln", "res", "drop"}
    assert wrapped.sequence_gathered == {"embed", "conv", "flat", "head"}
    x = np.random.default_rng(1).integers(0, 10, size=(16, 6)).astype("int32")
    y = np.random.default_rng(2).normal(size=(16, 3)).astype("float32")
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)
    ops = graph_ops(wrapped, x)
    conv = [op for op in ops if "/conv" in op.name and op.type == "Conv2D"]
    assert [_short(op.device) for op in conv] == cpus(0)
    # the conv reads the whole sequence: the row layer's pieces joined
    joins = [op for op in ops if op.name.rsplit("/", 1)[-1].startswith(SEQUENCE_SHARDS)]
    assert joins
    assert wrapped.sequence_gathered == {"embed", "conv", "flat", "head", "drop"}  # drop: traced
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    batches = [(x, y)] * 3
    assert_losses_match(step_losses(wrapped, batches), step_losses(reference, batches))


def test_sequence_parallel_off_runs_replicated_layers_whole_on_every_rank():
    """Without sequence parallelism the SPMD engine (apply.spmd) runs an unsplit layer
    between split ones on every tensor-parallel rank, whole (Megatron)."""
    from tfplan.apply.spmd import SpmdModel

    module, model = base_model("tiny_transformer")
    plan = sp_plan(model, [cpus(0, 1)], SPLITS["tiny_transformer"], sequence_parallel=False)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    x, _ = module.sample_batch(GLOBAL_BATCH)
    ln = [op for op in graph_ops(wrapped, x) if "/ln_attention" in op.name and op.device]
    assert {_short(op.device) for op in ln} == set(cpus(0, 1))


def test_uneven_sequence_pieces_train_the_same():
    """tp = 3 over a sequence of 8: pieces of 3, 3 and 2 tokens (4 heads 2/1/1)."""
    module, model = base_model("tiny_transformer")
    plan = sp_plan(model, [cpus(0, 1, 2)], SPLITS["tiny_transformer"], cluster_size=6)
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS_SP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, helpers.reference_losses("tiny_transformer", STEPS_SP)[:3])
    assert_placement(wrapped, plan)


@pytest.mark.parametrize("path", ["1f1b-m4", "zero1-dp2", "recompute-full", "run-eagerly"])
def test_other_train_steps_with_sequence_parallelism(path):
    """1F1B pipeline with 4 micro-batches, ZeRO-1 over dp2, full recomputation and an eager
    train step: the same losses (recomputed per-token layers hand on their output whole,
    so the next layer cuts it again; eager steps cannot find the pieces and cut every
    input: same numbers, more traffic)."""
    module, model = base_model("tiny_llama")
    kwargs, compile_kwargs = {}, {}
    devices = [cpus(0, 1)]
    if path == "1f1b-m4":
        devices, kwargs = [cpus(4, 5), cpus(6, 7)], dict(num_microbatches=4)
    elif path == "zero1-dp2":
        devices, kwargs = [cpus(0, 1, 2, 3)], dict(dp=2, zero=True)
    plan = sp_plan(model, devices, SPLITS["tiny_llama"], **kwargs)
    if path == "1f1b-m4":
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                      schedule="1f1b"))
    if path == "recompute-full":
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                      recompute="full"))
    if path == "run-eagerly":
        compile_kwargs = dict(run_eagerly=True)
    wrapped = apply.wrap(model, plan)
    if path == "recompute-full":
        assert PER_TOKEN["tiny_llama"] <= set(wrapped.recompute_layers)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss, **compile_kwargs)
    losses = step_losses(wrapped, batches_of(module, STEPS_SP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, helpers.reference_losses("tiny_llama", STEPS_SP)[:3])
    if path != "zero1-dp2":
        assert_placement(wrapped, plan)
        return
    tp = plan.strategy.tp  # ZeRO-1: slots on the owner copies only (tests/apply/test_zero.py)
    for r, replica in enumerate(wrapped.replica_models()):
        for layer in replica.layers:
            for v in layer.weights:
                assert _short(v.value.device) == expected_device(plan, layer, v, r * tp)
