"""apply.wrap with tensor-parallel plans (the SPMD engine, apply.spmd: every rank runs its
shards, partial sums in all-reduces) trains exactly like one device, with every shard and its optimizer slots on the device the plan names.

Runs on the 8 logical CPU devices of tests/conftest.py: the tiny MLP
(tests/apply/tiny_mlp.py) and a tiny transformer (tests/apply/tiny_transformer.py:
Embedding split by vocabulary, MultiHeadAttention by heads, Dense column/row, and
LayerNormalization replicated), tensor parallel alone, inside pipeline stages and with
data parallelism around it, with hand-made plans and one the planner made.
"""
from __future__ import annotations

import dataclasses
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.sharded_layers import _Sharded, shard_sizes
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.rank_layers import is_twin
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan, load_plan, save_plan
from tfplan.planner.validate import validate_plan
from tests.apply import helpers  # noqa: E402
from tests.apply.helpers import (GLOBAL_BATCH, HERE, assert_losses_match, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan, step_losses,
                                 tp_plan)

STEPS_TP = 10

SPLITS = {
    "tiny_mlp": (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
                 ("head", "row")),
    "tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                         ("mlp_down", "row"), ("logits", "column")),
}

# name: (model file, devices of each stage (dp x tp per stage), micro-batches, dp)
# tp2 and dp2 x tp2 with one micro-batch: tests/apply/test_acceptance.py
CASES = {
    "mlp-tp4": ("tiny_mlp", [cpus(4, 5, 6, 7)], 1, 1),
    "mlp-pp2-tp2-m2": ("tiny_mlp", [cpus(0, 1), cpus(2, 3)], 2, 1),
    "transformer-pp2-tp2": ("tiny_transformer", [cpus(4, 5), cpus(6, 7)], 1, 1),
    "mlp-dp2-tp2-m2": ("tiny_mlp", [cpus(0, 1, 2, 3)], 2, 2),
}


def reference_losses(name: str) -> list[float]:
    """Single-device losses of STEPS_TP steps from the same weights and batches."""
    return helpers.reference_losses(name, STEPS_TP)


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def expected_device(plan: Plan, layer, variable, offset: int = 0) -> str:
    """Where the plan puts ``variable`` of ``layer`` (in the replica whose rank 0 is
    ``devices[offset]``): shard t on its stage's tp rank t, anything unsplit on rank 0."""
    stage = next(s for s in plan.stages if layer.name in s.layers)
    match = re.search(r"_(\d+)$", variable.name)
    if isinstance(layer, _Sharded) and match:
        return stage.devices[offset + int(match.group(1))]
    return stage.devices[offset]


def assert_placement(model, plan: Plan) -> None:
    """Every variable of every replica where the plan says, each Adam slot with its
    variable (slots follow the trainable variables' order: Keras' optimizer lists); on the
    SPMD engine, every device's copy, its split layers the rank twins."""
    splits = dict(plan.tp_splits)
    if isinstance(model, SpmdModel):
        for copy in model.device_models:
            for layer in copy.layers:
                assert is_twin(layer) == (layer.name in splits), layer.name
        helpers.assert_state_where_planned(model, plan)
        return
    used = set()
    tp = plan.strategy.tp
    for r, replica in enumerate((model, *model._others.models)):
        for layer in replica.layers:
            assert isinstance(layer, _Sharded) == (layer.name in splits), layer.name
            for v in layer.weights:
                where = _short(v.value.device)
                want = expected_device(plan, layer, v, offset=r * tp)
                assert where == want, (r, layer.name, v.path, where)
                used.add(where)
    assert used == set(plan.devices)  # every rank of every replica holds shards
    variables = model.trainable_variables
    assert len(variables) == plan.strategy.dp * len(model.weights)
    optimizer = model.optimizer
    for slots in (optimizer._momentums, optimizer._velocities):
        assert len(slots) == len(variables)
        for v, slot in zip(variables, slots):
            assert tuple(slot.shape) == tuple(v.shape), (slot.path, v.path)
            assert _short(slot.value.device) == _short(v.value.device), (slot.path, v.path)


@pytest.mark.parametrize("case", list(CASES))
def test_losses_placement_and_predict(case):
    name, devices, m, dp = CASES[case]
    module, model = base_model(name)
    plan = tp_plan(model, devices, SPLITS[name], num_microbatches=m, dp=dp)
    wrapped = apply.wrap(model, plan)
    assert isinstance(wrapped, SpmdModel)
    batches = batches_of(module, STEPS_TP, GLOBAL_BATCH)
    x, _ = batches[0]
    # before training: the sharded model computes the user's model's function
    np.testing.assert_allclose(wrapped.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
                               model.predict_on_batch(x), rtol=1e-5, atol=1e-5)
    for got, want in zip(wrapped.get_weights(), model.get_weights()):  # read back unsplit
        np.testing.assert_array_equal(got, want)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches), reference_losses(name))
    assert_placement(wrapped, wrapped.plan)
    assert_replicas_equal(wrapped)  # every copy of a weight stayed equal to replica 0's
    # the wrapped model's weights are the user's model's arrays, in its order and shapes
    assert [w.shape for w in wrapped.get_weights()] == [w.shape for w in model.get_weights()]
    wrapped.set_weights(model.get_weights())  # back to the start, on every replica
    assert_replicas_equal(wrapped)
    np.testing.assert_allclose(wrapped.predict_on_batch(x), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-5)


def assert_replicas_equal(wrapped) -> None:
    """Tensor rank t's copy in every replica holds replica 0's arrays."""
    if not isinstance(wrapped, SpmdModel):  # the older engine (sequence parallelism)
        for replica in wrapped._others.models:
            for mine, theirs in zip(wrapped.weights, replica.weights):
                np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
        return
    tp = wrapped.run_description.tp
    first = wrapped.device_models[:tp]
    for i, copy in enumerate(wrapped.device_models[tp:]):
        for mine, theirs in zip(first[i % tp].weights, copy.weights):
            np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def _forward_ops(wrapped, x, layer_name: str) -> list:
    graph = tf.function(lambda t: wrapped(t)).get_concrete_function(tf.constant(x)).graph
    return [op for op in graph.get_operations() if f"/{layer_name}" in op.name]


def test_shards_compute_on_their_devices_and_row_reads_column_shards():
    module, model = base_model("tiny_transformer")
    plan = tp_plan(model, [cpus(2, 3)], SPLITS["tiny_transformer"])
    wrapped = apply.wrap(model, plan)
    x, _ = module.sample_batch(GLOBAL_BATCH)
    down = _forward_ops(wrapped, x, "mlp_down")
    matmuls = sorted(_short(op.device) for op in down if op.type == "MatMul")
    assert matmuls == cpus(2, 3)  # one partial product per rank
    # the partial sums meet in one all-reduce per rank: no device sums for the other
    assert not [op for op in down if op.type == "AddN"]
    assert sorted(_short(op.device) for op in down
                  if op.type == "CollectiveReduceV2") == cpus(2, 3)
    # the column -> row pair moves no activation: no slicing of the gathered output
    assert not [op for op in down if op.type == "StridedSlice"]
    heads = [op for op in _forward_ops(wrapped, x, "attention") if op.type == "Einsum"]
    assert sorted({_short(op.device) for op in heads}) == cpus(2, 3)


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_transformer"])
def test_save_weights_load_into_the_users_model(name, tmp_path):
    module, model = base_model(name)
    # tp = 3 cuts uneven shards (MLP: 32 units 11/11/10, the 3-unit head 1/1/1; transformer:
    # 24 words 8/8/8, 4 heads 2/1/1) on a cluster of 6 (tp divides it)
    wrapped = apply.wrap(model, tp_plan(model, [cpus(0, 1, 2)], SPLITS[name], cluster_size=6))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, 2, GLOBAL_BATCH)
    step_losses(wrapped, batches)
    path = str(tmp_path / "tp.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.load_weights(path)  # unsplit shapes: the user's architecture reads them
    x = batches[0][0]
    np.testing.assert_allclose(wrapped.predict_on_batch(x), plain.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
    again = apply.wrap(model, tp_plan(model, [cpus(0, 1)], SPLITS[name]))
    again.load_weights(path)  # and a differently split model too
    np.testing.assert_allclose(again.predict_on_batch(x), plain.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)


def test_uneven_shards():
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(3, 3) == [1, 1, 1]


def test_a_planner_made_plan_trains(tmp_path):
    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    source = load_model_source(os.path.join(HERE, "tiny_transformer.py"))
    profile = profile_source(source, batch_size=1)
    # a large global batch makes splitting pay on cpu:8 (at 16 samples the ILP splits nothing)
    plan = search(profile, parse_cluster("cpu:8"), 4096,
                  fix={"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}).chosen
    assert dict(plan.tp_splits) == dict(SPLITS["tiny_transformer"])
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.tp_splits == plan.tp_splits
    module, model = base_model("tiny_transformer")
    wrapped = apply.wrap(model, loaded)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS_TP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, reference_losses("tiny_transformer")[:3])
    assert_placement(wrapped, wrapped.plan)


# --- plan field and its checks ------------------------------------------------------------
def test_tp_splits_round_trip_and_old_files_load(tmp_path):
    _, model = base_model("tiny_mlp")
    plan = tp_plan(model, [cpus(0, 1)], SPLITS["tiny_mlp"])
    assert Plan.from_dict(plan.to_dict()) == plan
    doc = plan.to_dict()
    assert doc["tp_splits"] == dict(SPLITS["tiny_mlp"])
    del doc["tp_splits"]  # a plan.json written before the field existed
    assert Plan.from_dict(doc).tp_splits == ()
    single = make_plan(model, [cpus(0)])
    assert "tp_splits" not in single.to_dict()


@pytest.mark.parametrize("splits, message", [
    ((("hidden", "diagonal"),), "expected one of"),
    ((("nope", "column"),), "does not have"),
    ((("hidden", "row"), ("hidden", "column")), "twice"),
])
def test_validate_rejects_bad_tp_splits(splits, message):
    _, model = base_model("tiny_mlp")
    plan = tp_plan(model, [cpus(0, 1)], splits)
    with pytest.raises(PlanMismatchError, match=message):
        validate_plan(plan, plan.model_signature)


def test_validate_rejects_splits_without_tp():
    _, model = base_model("tiny_mlp")
    plan = dataclasses.replace(make_plan(model, [cpus(0)]), tp_splits=(("hidden", "row"),))
    with pytest.raises(PlanMismatchError, match="tp = 1"):
        validate_plan(plan, plan.model_signature)


@pytest.mark.parametrize("name, splits, match", [
    ("tiny_transformer", (("ln_mlp", "column"),), r"'ln_mlp' \(LayerNormalization\) by "
                                                   r"'column'.*Dense, EinsumDense"),
    ("tiny_mlp", (("hidden", "heads"),), r"'hidden' \(Dense\) by 'heads'"),
    ("tiny_transformer", (("embed", "row"),), r"'embed' \(Embedding\) by 'row'"),
])
def test_unsplittable_layer_is_a_clear_error(name, splits, match):
    _, model = base_model(name)
    with pytest.raises(PlannerError, match=match):
        apply.wrap(model, tp_plan(model, [cpus(0, 1)], splits))


def test_too_few_heads_for_tp():
    _, model = base_model("tiny_transformer")  # 4 heads
    plan = tp_plan(model, [cpus(0, 1, 2, 3, 4, 5, 6, 7)], (("attention", "heads"),))
    with pytest.raises(PlannerError, match="at least one head"):
        apply.wrap(model, plan)


def test_a_worker_local_tp_plan_is_not_wrapped_whole():
    """dp2 x tp2 over two workers runs one program per worker (the SPMD engine builds each
    worker's part: tests/apply/test_workers.py); handing the whole plan to
    wrap_tensor_parallel is refused."""
    _, model = base_model("tiny_mlp")
    workers = tuple(f"/job:worker/task:{w}/device:CPU:{i}" for w in range(2) for i in range(2))
    plan = tp_plan(model, [list(workers)], SPLITS["tiny_mlp"], dp=2)
    from tfplan.apply.tensor_parallel import wrap_tensor_parallel

    with pytest.raises(PlannerError, match="runs through apply.wrap"):
        wrap_tensor_parallel(model, plan, {})


def _einsum_model():
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input(shape=(4, 6), name="seq")
    x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(4, 10), bias_axes="d",
                                 activation="relu", name="up")(x)
    x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(4, 6), bias_axes="d",
                                 name="down")(x)
    # the output's last axis (e) is cut, the bias (over d) is added after the join
    x = keras.layers.EinsumDense("abc,cde->abde", output_shape=(4, 2, 3), bias_axes="d",
                                 activation="tanh", name="pairs")(x)
    x = keras.layers.Flatten(name="flat")(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    return keras.Model(inputs, outputs, name="einsum_mlp")


def test_einsum_dense_column_and_row():
    model = _einsum_model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_TP * GLOBAL_BATCH, 4, 6)).astype("float32")
    y = np.stack([x.sum((1, 2)), x[:, 0, 0] * x[:, 1, 1]], 1).astype("float32")
    batches = [(x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], y[i * GLOBAL_BATCH:(i + 1) *
                                                              GLOBAL_BATCH])
               for i in range(5)]
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    want = step_losses(reference, batches)
    plan = tp_plan(model, [cpus(1, 2)], (("up", "column"), ("down", "row"),
                                         ("pairs", "column"), ("head", "row")))
    wrapped = apply.wrap(model, plan)
    np.testing.assert_allclose(wrapped.predict_on_batch(batches[0][0]),
                               model.predict_on_batch(batches[0][0]), rtol=1e-5, atol=1e-6)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    assert_losses_match(step_losses(wrapped, batches), want)
    assert_placement(wrapped, wrapped.plan)


def test_einsum_dense_that_cannot_be_cut_is_a_clear_error():
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(4, 6))
    # the input's last axis (c) is kept in the output: nothing to cut by rows
    outputs = keras.layers.EinsumDense("abc,bd->acd", output_shape=(6, 3), name="mix")(inputs)
    model = keras.Model(inputs, outputs)
    with pytest.raises(PlannerError, match=r"'mix'.*cannot be split by 'row'"):
        apply.wrap(model, tp_plan(model, [cpus(0, 1)], (("mix", "row"),)))


def test_recomputed_sharded_layers_train_the_same():
    module, model = base_model("tiny_transformer")
    plan = tp_plan(model, [cpus(0, 1)], SPLITS["tiny_transformer"])
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  recompute="selective"))
    wrapped = apply.wrap(model, plan)
    # selective: the split attention's core alone is recomputed (apply.recompute)
    assert wrapped.run_description.recompute == "selective"
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS_TP, GLOBAL_BATCH)[:3])
    assert_losses_match(losses, reference_losses("tiny_transformer")[:3])


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_transformer"])
def test_saved_model_loads_as_the_users_unsplit_model(name, tmp_path):
    module, model = base_model(name)
    wrapped = apply.wrap(model, tp_plan(model, [cpus(0, 1)], SPLITS[name]))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    batches = batches_of(module, 2, GLOBAL_BATCH)
    step_losses(wrapped, batches)
    path = str(tmp_path / "tp.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path, compile=False)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    x = batches[0][0]
    np.testing.assert_allclose(loaded.predict_on_batch(x), wrapped.predict_on_batch(x),
                               rtol=1e-5, atol=1e-6)
