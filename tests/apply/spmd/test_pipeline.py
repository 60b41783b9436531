"""Pipelines on the SPMD engine (apply.spmd.pipeline, apply.spmd.stages): each column's
chunks on their own devices, slot by slot in the schedule's order, trained like one device,
sending what the plan prices.

Each case builds the wrapped model from the model file's builder (seed 0), a one-device
reference from the wrapped model's starting weights, and compares per-step losses and the
final weights (1e-4 relative, float32).
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.audit import audit_step
from tfplan.apply.spmd.pipeline import device_orders, slot_order
from tfplan.apply.spmd.run import describe
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import Stage
from tfplan.planner.traffic import plan_sent_bytes
from tfplan.profiler import profile_model
from tests.apply import helpers
from tests.apply.spmd.test_engine import SPLITS, _named, wrapped_and_reference

STEPS, BATCH = 3, 16


def _plan(model, name, *, pp=2, dp=1, tp=1, m=2, schedule="1f1b", v=1, zero=0,
          recompute="none", offload="none"):
    """A pipeline plan: chunk k on pipeline device k % pp, each a dp x tp grid of CPUs."""
    n = dp * tp
    grids = [helpers.cpus(*range(d * n, (d + 1) * n)) for d in range(pp)]
    plan = helpers.tp_plan(model, grids, _named(SPLITS[name], model) if tp > 1 else (),
                           dp=dp, num_microbatches=m, global_batch=BATCH, zero=zero)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, recompute=recompute, offload=offload))
    if v > 1:
        layers = [name for stage in plan.stages for name in stage.layers]
        bounds = np.linspace(0, len(layers), pp * v + 1).round().astype(int)
        plan = dataclasses.replace(plan, stages=tuple(
            Stage(layers=tuple(layers[bounds[k]:bounds[k + 1]]), devices=tuple(grids[k % pp]))
            for k in range(pp * v)))
    return dataclasses.replace(_whole_blocks(plan), name=f"{plan.name} {schedule} v={v}",
                               strategy=dataclasses.replace(
                                   plan.strategy, schedule=schedule, virtual_stages=v))


def _whole_blocks(plan):
    """``plan`` with every block's sub-layers on the block's stage (a layer with sub-layers
    runs whole on one stage, as the planner cuts: apply refuses a boundary inside one)."""
    stage_of = {name: k for k, stage in enumerate(plan.stages) for name in stage.layers}

    def home(name):
        parts = name.split("/")
        blocks = ["/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i])
                  in stage_of]
        return stage_of[blocks[0]] if blocks else stage_of[name]

    order = [name for stage in plan.stages for name in stage.layers]
    return dataclasses.replace(plan, stages=tuple(
        Stage(layers=tuple(n for n in order if home(n) == k), devices=stage.devices)
        for k, stage in enumerate(plan.stages)))


def _wrapped(name, optimizer=None, **shape):
    """(module, plan, wrapped, one-device reference with its weights); ``optimizer``: a
    function making the optimizer (the model file's by default)."""
    module = helpers.load_model_file(name)
    keras.utils.set_random_seed(0)
    plan = _plan(module.build_model(), name, **shape)
    return (module, plan, *wrapped_and_reference(module, plan, optimizer))


def _batches(module, steps=STEPS):
    x, y = module.sample_batch(steps * BATCH)
    return [(keras.tree.map_structure(lambda a, i=i: a[i * BATCH:(i + 1) * BATCH], x),
             y[i * BATCH:(i + 1) * BATCH]) for i in range(steps)]


def _device(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


def _assert_each_weight_on_its_chunk(wrapped, plan):
    """Every weight of a column on the device of the chunk whose layer uses it, each
    optimizer slot beside it; every chunk's devices hold weights."""
    run = wrapped.run_description
    opt = wrapped.optimizer
    used = set()
    for q, row in enumerate(wrapped._copies.programs):
        for t, program in enumerate(row):
            column = run.column(q, t)
            for step in program.steps:
                for w in getattr(step.layer, "weights", ()):
                    where = _device(w.value.device)
                    assert where == _device(column[step.chunk]), (w.path, step.chunk)
                    used.add(where)
                    if w.trainable and hasattr(opt, "_momentums"):  # Adam's
                        i = opt._get_variable_index(w)
                        assert _device(opt._momentums[i].value.device) == where
    assert used == {_device(d) for d in plan.devices}


@pytest.mark.parametrize("name, shape", [
    ("tiny_mlp", dict(m=2, schedule="gpipe")),
    ("tiny_transformer", dict(dp=2, m=2)),
    ("tiny_transformer", dict(tp=2, m=2)),
    ("tiny_cnn", dict(m=4, schedule="interleaved", v=2)),
    ("tiny_seq2seq", dict(m=4)),  # Keras masks cross the stage boundary
    ("tiny_hub", dict(m=2)),  # a keras_hub backbone nested in the model, cut inside
])
def test_trains_like_one_device_with_each_weight_on_its_stage(name, shape):
    module, plan, wrapped, reference = _wrapped(name, **shape)
    batches = _batches(module)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)
    _assert_each_weight_on_its_chunk(wrapped, plan)


@pytest.mark.parametrize("name, shape, clip", [
    # ZeRO-1 under a pipeline: each chunk's shards on its devices; the global norm over
    # every chunk of the column (an Embedding's sparse gradient made dense, as Keras does)
    ("tiny_transformer", dict(dp=2, m=2, zero=1), dict(global_clipnorm=0.05)),
    # ZeRO-2: each backward slot's gradients reduce-scattered at once; ZeRO-3: each chunk's
    # layers gathered from their shards per micro-batch (and tp inside, 1F1B)
    ("tiny_mlp", dict(dp=2, m=2, zero=2), dict(global_clipnorm=0.05)),
    ("tiny_transformer", dict(dp=2, tp=2, m=2, zero=3), dict(clipnorm=0.1)),
    # recomputed split layers, the optimizer state on the host, per-weight norms
    ("tiny_mlp", dict(tp=2, m=2, recompute="full", offload="optimizer"), dict(clipnorm=0.1)),
])
def test_zero_recompute_offload_and_clipping_under_a_pipeline(name, shape, clip):
    module, plan, wrapped, reference = _wrapped(
        name, optimizer=lambda: keras.optimizers.Adam(1e-2, **clip), **shape)
    batches = _batches(module)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches))
    for got, want in zip(wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)
    opt = wrapped.optimizer
    if shape.get("zero"):  # the optimizer holds each device's shards, beside them
        shards = wrapped._zero.variables
        assert {_device(s.value.device) for s in shards} == {_device(d) for d in plan.devices}
        for s in shards:
            i = opt._get_variable_index(s)
            assert _device(opt._momentums[i].value.device) == _device(s.value.device)
    if shape.get("offload") == "optimizer":
        assert all(_device(v.value.device) == ("CPU", 0) for v in opt._momentums)


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"], indirect=True)
def test_mixed_precision_under_a_pipeline_trains_like_one_device(policy):
    module, _, wrapped, reference = _wrapped("tiny_transformer", tp=2, m=2)
    batches = _batches(module)
    helpers.assert_losses_match(helpers.step_losses(wrapped, batches),
                                helpers.step_losses(reference, batches), rtol=2e-2)


@pytest.mark.parametrize("name, shape", [("tiny_mlp", dict(dp=2, tp=2, m=2, zero=1)),
                                         pytest.param("tiny_mlp", dict(dp=2, m=2, zero=2),
                                                      marks=pytest.mark.slow),
                                         ("tiny_mlp", dict(dp=2, m=2, zero=3))])
def test_each_device_sends_what_the_plan_prices_and_no_device_is_a_hub(name, shape):
    module, plan, wrapped, _ = _wrapped(name, **shape)
    x, y = module.sample_batch(BATCH)
    audit = audit_step(wrapped, x, y, plan=plan)
    measured = audit.by_device()
    keras.utils.set_random_seed(0)
    priced = {d: dict(kinds) for d, kinds in
              plan_sent_bytes(profile_model(module.build_model(), batch_size=BATCH), plan)}
    assert not audit.unsized
    for device in plan.devices:
        assert measured[device]["pp"] > 0, device  # activations or their gradients
        for kind in ("tp", "pp", "dp", "zero"):
            assert measured[device][kind] == pytest.approx(priced[device][kind], rel=0.10,
                                                           abs=64), (device, kind)
    for stage in plan.stages:  # the devices of one stage do the same work
        totals = [sum(v for k, v in measured[d].items() if k != "input") for d in stage.devices]
        assert max(totals) <= 1.25 * sum(totals) / len(totals)


def test_evaluate_predict_and_a_weight_file_are_one_devices(tmp_path):
    module, _, wrapped, reference = _wrapped("tiny_seq2seq", dp=2, m=2)
    x, y = module.sample_batch(BATCH)
    wrapped.train_on_batch(x, y)
    reference.train_on_batch(x, y)
    assert wrapped.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-4)
    np.testing.assert_allclose(wrapped.predict(x, batch_size=BATCH, verbose=0),
                               reference.predict(x, batch_size=BATCH, verbose=0),
                               rtol=1e-4, atol=1e-5)
    path = str(tmp_path / "w.weights.h5")
    wrapped.save_weights(path)
    plain = module.build_model()
    plain.load_weights(path)
    for got, want in zip(plain.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_one_f_one_b_bounds_the_micro_batches_in_flight():
    """Under 1F1B stage 0's forward of micro-batch j waits for the backward of j - pp
    (a control dependency on the marker of that backward slot); under GPipe none waits."""
    module, plan, wrapped, _ = _wrapped("tiny_mlp", m=4)
    x, y = module.sample_batch(BATCH)
    run = wrapped.run_description
    order = slot_order(run)
    for d, own in enumerate(device_orders(run)):
        mine = [s for s in order if s.stage % run.pp == d]
        assert mine == list(own)  # each device's slots keep its schedule's order
    seen = set()
    for s in order:  # and the data flow
        if s.kind == "F" and s.stage > 0:
            assert ("F", s.microbatch, s.stage - 1) in seen
        if s.kind == "B":
            assert ("F", s.microbatch, s.stage) in seen
            if s.stage < run.chunks - 1:
                assert ("B", s.microbatch, s.stage + 1) in seen
        seen.add((s.kind, s.microbatch, s.stage))
    markers = _markers(wrapped, x, y)
    assert "pipeline_backward_mb0_stage0_done" in markers  # F(2, 0) waits for B(0, 0)
    gpipe = _wrapped("tiny_mlp", m=4, schedule="gpipe")[2]
    assert not _markers(gpipe, x, y)


def _markers(wrapped, x, y):
    fn = tf.function(lambda a, b: wrapped.train_step((a, b)))
    graph = fn.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    return {op.name for op in graph.get_operations() if op.name.startswith("pipeline_backward")}


def test_models_a_pipeline_cannot_cut_are_refused_with_the_fix():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")

        def call(self, x):
            return self.b(self.a(x))

    def build():
        model = Subclassed()
        model(np.zeros((1, 3), "float32"))
        return model

    plan = helpers.make_plan(build(), [helpers.cpus(0), helpers.cpus(1)], num_microbatches=2)
    with pytest.raises(PlannerError, match="Functional API"):
        apply.wrap(build, dataclasses.replace(plan, strategy=dataclasses.replace(
            plan.strategy, schedule="1f1b")))

    def shared():  # one layer called on stage 0 and again after a stage-1 layer
        x = keras.Input((8,))
        proj = keras.layers.Dense(8, name="proj")
        h = keras.layers.Dense(8, name="mid")(proj(x))
        return keras.Model(x, keras.layers.Dense(3, name="out")(proj(h)))

    plan = helpers.make_plan(shared(), [helpers.cpus(0), helpers.cpus(1)],
                             num_microbatches=2, stage_layers=[["proj"], ["mid", "out"]])
    assert describe(plan).chunks == 2
    with pytest.raises(PlannerError, match="stages must cut the model's graph in order"):
        apply.wrap(shared, plan)


def test_1f1b_on_a_masked_output_with_added_losses_is_refused_with_the_fix():
    """Under 1F1B the slots weigh the loss by an estimate of the mask's counts and the
    step corrects every gradient once the counts are known, which would scale the added
    losses' gradients too (they divide by rows): refused, naming GPipe; GPipe trains."""
    def build():
        keras.utils.set_random_seed(0)
        ids = keras.Input((6,), dtype="int32", name="ids")
        x = keras.layers.Embedding(10, 4, mask_zero=True, name="embed")(ids)
        x = keras.layers.Dense(8, activation="tanh", name="hidden",
                               activity_regularizer=keras.regularizers.L2(0.05))(x)
        return keras.Model(ids, keras.layers.Dense(3, name="head")(x))

    rng = np.random.default_rng(0)
    x = rng.integers(1, 10, size=(BATCH, 6)).astype("int32")
    x[:, 4:] = 0  # padding, masked out of the loss
    y = rng.integers(0, 3, size=(BATCH, 6)).astype("int32")
    for schedule in ("1f1b", "gpipe"):
        plan = helpers.make_plan(build(), [helpers.cpus(0), helpers.cpus(1)],
                                 num_microbatches=2, global_batch=BATCH,
                                 stage_layers=[["embed", "hidden"], ["head"]])
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(
            plan.strategy, schedule=schedule))
        wrapped = apply.wrap(build, plan)
        wrapped.compile(optimizer="sgd",
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if schedule == "1f1b":
            with pytest.raises(PlannerError, match="Keras mask and which adds losses.*"
                                                   "--schedule gpipe"):
                wrapped.train_on_batch(x, y)
        else:
            assert np.isfinite(wrapped.train_on_batch(x, y))
