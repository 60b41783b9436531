"""Sharded convolutions (apply.sharded_layers, column = filters, row = input channels)
compute the unsplit layer's outputs and gradients, with each shard on its device.

Each case clones a small Keras model with ``sharded_clone`` for the named layers (the
way ``apply.tensor_parallel`` does), copies the unsplit weights in, and compares a
forward pass and the gradients of a scalar loss with respect to the input and to every
weight (read back unsplit) against the unsplit model, at rtol 1e-5. Then through
``apply.wrap``: a planner-made plan for the residual CNN (tests/apply/tiny_cnn.py) that
splits its convolutions trains like one device, and a split CNN's weight files and
saved models are the unsplit model's (the planner's plan on the SPMD engine, tp = 3's
unequal filters on the older one). Runs on the 8 logical CPU devices of
tests/conftest.py.
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.sharded_layers import _Sharded, sharded_clone
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.rank_layers import RankConv2D
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import load_plan, save_plan
from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.profiler.loader import load_model_source
from tfplan.profiler.static import profile_source
from tests.apply.helpers import (GLOBAL_BATCH, HERE, assert_losses_match, base_model,
                                 batches_of, cpus, fresh_optimizer, make_plan, step_losses)

DEVICES = cpus(1, 2)
RTOL, ATOL = 1e-5, 1e-6


def _conv2d_pair(activation: str = "relu") -> keras.Model:
    """Conv2D (column candidate, 7 filters: uneven shards 4/3) -> Conv2D (row candidate)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(6, 6, 5), name="image")
    x = keras.layers.Conv2D(7, 3, padding="same", activation=activation, name="first",
                            bias_initializer="glorot_uniform")(inputs)
    x = keras.layers.Conv2D(4, (3, 2), strides=(2, 1), padding="valid", name="second",
                            bias_initializer="glorot_uniform")(x)
    return keras.Model(inputs, x, name="conv_pair")


def _conv1d_pair() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(10, 6), name="seq")
    x = keras.layers.Conv1D(5, 3, padding="causal", dilation_rate=2, activation="tanh",
                            name="first", bias_initializer="glorot_uniform")(inputs)
    x = keras.layers.Conv1D(3, 2, padding="same", name="second",
                            bias_initializer="glorot_uniform")(x)
    return keras.Model(inputs, x, name="conv1d_pair")


def _conv3d_pair() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(4, 4, 4, 3), name="volume")
    x = keras.layers.Conv3D(4, 2, activation="relu", name="first",
                            bias_initializer="glorot_uniform")(inputs)
    x = keras.layers.Conv3D(2, 2, name="second", bias_initializer="glorot_uniform")(x)
    return keras.Model(inputs, x, name="conv3d_pair")


def _split(model: keras.Model, splits: dict[str, str], devices=DEVICES) -> keras.Model:
    """``model`` cloned with ``splits``' layers sharded over ``devices``, weights copied."""

    def clone_function(layer):
        if layer.name in splits:
            return sharded_clone(layer, splits[layer.name], devices)
        return layer.__class__.from_config(layer.get_config())

    with tf.device(devices[0]):
        clone = keras.models.clone_model(model, clone_function=clone_function)
    for layer in model.layers:
        if layer.weights:
            clone.get_layer(layer.name).set_weights(layer.get_weights())
    return clone


def _outputs_and_grads(model: keras.Model, x: np.ndarray, graph: bool):
    """Forward output, d loss / d input and d loss / d weights (unsplit, layer order)."""

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
            loss = tf.reduce_sum(tf.sin(y) * tf.range(1.0, 1.0 + y.shape[-1]))
        variables = model.trainable_variables
        return (y, *tape.gradient(loss, [x, *variables]))

    fn = tf.function(run) if graph else run
    y, dx, *dw = fn(tf.constant(x))
    return y.numpy(), dx.numpy(), _unsplit_grads(model, dw)


def _unsplit_grads(model: keras.Model, grads) -> list[np.ndarray]:
    """The weight gradients of ``model`` regrouped as its unsplit weights (a sharded
    layer's shard gradients concatenated the way its weights are)."""
    by_id = {id(v): g.numpy() for v, g in zip(model.trainable_variables, grads)}
    out = []
    for layer in model.layers:
        if isinstance(layer, _Sharded):
            column = layer.tp_split == "column"
            out.append(np.concatenate([by_id[id(k)] for k in layer.kernels],
                                      axis=-1 if column else -2))
            if layer.biases:
                out.append(np.concatenate([by_id[id(b)] for b in layer.biases])
                           if column else by_id[id(layer.biases[0])])
        else:
            out.extend(by_id[id(w)] for w in layer.trainable_weights)
    return out


CASES = {
    "conv2d-column": (_conv2d_pair, {"first": "column"}),
    "conv2d-row": (_conv2d_pair, {"second": "row"}),
    "conv2d-row-reads-the-input": (_conv2d_pair, {"first": "row"}),
    "conv2d-column-row-pair": (_conv2d_pair, {"first": "column", "second": "row"}),
    "conv2d-column-column": (_conv2d_pair, {"first": "column", "second": "column"}),
    "conv1d-causal-dilated-pair": (_conv1d_pair, {"first": "column", "second": "row"}),
    "conv3d-pair": (_conv3d_pair, {"first": "column", "second": "row"}),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_conv_matches_the_unsplit_layer(case, graph):
    build, splits = CASES[case]
    model = build()
    split = _split(model, splits)
    x = np.random.default_rng(3).normal(size=(3, *model.input_shape[1:])).astype("float32")
    want = _outputs_and_grads(model, x, graph)
    got = _outputs_and_grads(split, x, graph)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    assert len(got[2]) == len(want[2])
    for g, w in zip(got[2], want[2]):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    # weights read back unsplit, as the user's layer's
    for name in splits:
        for got_w, want_w in zip(split.get_layer(name).get_weights(),
                                 model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(got_w, want_w)


def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def test_shards_live_and_compute_on_their_devices():
    model = _conv2d_pair()
    devices = cpus(4, 5, 6)  # 7 filters over 3 ranks: 3/2/2; 7 input channels of row
    split = _split(model, {"first": "column", "second": "row"}, devices)
    first, second = split.get_layer("first"), split.get_layer("second")
    assert [tuple(k.shape) for k in first.kernels] == [(3, 3, 5, 3), (3, 3, 5, 2),
                                                       (3, 3, 5, 2)]
    assert [tuple(b.shape) for b in first.biases] == [(3,), (2,), (2,)]
    assert [tuple(k.shape) for k in second.kernels] == [(3, 2, 3, 4), (3, 2, 2, 4),
                                                        (3, 2, 2, 4)]
    assert [tuple(b.shape) for b in second.biases] == [(4,)]  # added once, after the sum
    for layer in (first, second):
        assert [_short(k.value.device) for k in layer.kernels] == devices
    assert [_short(b.value.device) for b in first.biases] == devices
    assert _short(second.biases[0].value.device) == devices[0]  # the layer's device
    x = np.zeros((2, 6, 6, 5), "float32")

    def forward(t):
        with tf.device(devices[0]):  # the layer's device (apply.tensor_parallel calls it so)
            return split(t)

    graph = tf.function(forward).get_concrete_function(tf.constant(x)).graph
    ops_of = {name: [op for op in graph.get_operations() if f"/{name}" in op.name]
              for name in ("first", "second")}
    assert sorted(_short(op.device) for op in ops_of["first"]
                  if op.type == "Conv2D") == devices
    assert sorted(_short(op.device) for op in ops_of["second"]
                  if op.type == "Conv2D") == devices
    # the column -> row pair moves no activation: the row shards read the column shards
    assert not [op for op in ops_of["second"] if op.type == "StridedSlice"]
    assert [_short(op.device) for op in ops_of["second"] if op.type == "AddN"] == devices[:1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(groups=2), "groups=2"),
    (dict(data_format="channels_first"), "data_format='channels_first'"),
])
def test_unsupported_conv_configs_are_clear_errors(kwargs, message):
    keras.utils.set_random_seed(0)
    shape = (4, 6, 6) if kwargs.get("data_format") == "channels_first" else (6, 6, 4)
    inputs = keras.Input(shape=shape)
    outputs = keras.layers.Conv2D(4, 3, name="odd", **kwargs)(inputs)
    model = keras.Model(inputs, outputs)
    with pytest.raises(PlannerError, match=rf"'odd' cannot be split by 'column'.*{message}"):
        _split(model, {"odd": "column"})


def test_conv_subclass_and_other_splits_are_refused():
    class MyConv(keras.layers.Conv2D):
        pass

    layer = MyConv(4, 3, name="mine")
    with pytest.raises(PlannerError, match=r"'mine' \(MyConv\) by 'column'"):
        sharded_clone(layer, "column", DEVICES)
    with pytest.raises(PlannerError, match=r"\(Conv2D\) by 'heads'"):
        sharded_clone(keras.layers.Conv2D(4, 3, name="plain"), "heads", DEVICES)


# --- through apply.wrap: the CNN's convolutions split by a plan -------------------------------
CNN_SPLITS = (("stem", "row"), ("res_a", "column"), ("res_b", "row"))


def _tp_plan(model, devices, splits, global_batch=GLOBAL_BATCH):
    # a cluster of 6 for tp = 3 (tp must divide the devices of a node)
    plan = make_plan(model, [devices], global_batch=global_batch,
                     cluster_size=8 if 8 % len(devices) == 0 else 6)
    strategy = dataclasses.replace(plan.strategy, dp=1, tp=len(devices),
                                   microbatch_size=global_batch)
    return dataclasses.replace(plan, strategy=strategy, tp_splits=tuple(splits),
                               name=f"test conv tp={len(devices)}")


def test_a_planner_made_cnn_plan_splits_convolutions_and_trains(tmp_path):
    profile = profile_source(load_model_source(f"{HERE}/tiny_cnn.py"), batch_size=1)
    # 256 samples per step make the conv splits pay on cpu:8 (tests/planner/test_conv_splits)
    plan = search(profile, parse_cluster("cpu:8"), 256,
                  fix={"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}).chosen
    save_plan(plan, tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    conv_splits = [(n, s) for n, s in plan.tp_splits if n in ("stem", "res_a", "res_b")]
    assert len(conv_splits) >= 2, plan.tp_splits
    module, model = base_model("tiny_cnn")
    wrapped = apply.wrap(model, plan)  # the SPMD engine: each rank's shard in its copy
    assert isinstance(wrapped, SpmdModel)
    for copy, device in zip(wrapped.device_models, plan.stages[0].devices):
        for name, split in conv_splits:
            layer = copy.get_layer(name)
            assert isinstance(layer, RankConv2D) and layer.tp_rank.split == split
            assert _short(layer.kernel.value.device) == _short(device)
    batches = batches_of(module, 3, GLOBAL_BATCH)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    assert_losses_match(step_losses(wrapped, batches), step_losses(reference, batches))


def test_split_cnn_saves_unsplit_weights_and_models(tmp_path):
    module, model = base_model("tiny_cnn")
    # tp = 3: 8 filters cut 3/3/2, the stem's 3 input channels 1/1/1
    wrapped = apply.wrap(model, _tp_plan(model, cpus(0, 1, 2), CNN_SPLITS))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    x, y = module.sample_batch(GLOBAL_BATCH)
    wrapped.train_on_batch(x, y)
    path = str(tmp_path / "tp.weights.h5")
    wrapped.save_weights(path)
    plain = keras.models.clone_model(model)
    plain.load_weights(path)  # unsplit Conv2D kernels: the user's architecture reads them
    want = wrapped.predict_on_batch(x)
    np.testing.assert_allclose(plain.predict_on_batch(x), want, rtol=RTOL, atol=ATOL)
    again = apply.wrap(model, _tp_plan(model, cpus(3, 4), CNN_SPLITS))
    again.load_weights(path)  # and a differently split model too
    np.testing.assert_allclose(again.predict_on_batch(x), want, rtol=RTOL, atol=ATOL)
    saved = str(tmp_path / "tp.keras")
    wrapped.save(saved)
    loaded = keras.models.load_model(saved, compile=False)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    np.testing.assert_allclose(loaded.predict_on_batch(x), want, rtol=RTOL, atol=ATOL)
