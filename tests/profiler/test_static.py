"""Static profiles of the example models, checked against numbers computed by hand.

Every expected number below is written out from the architecture and the
conventions in ``profiler.layer_flops`` (2 FLOPs per multiply-add, bias and
ReLU 1 per output element, BatchNormalization 7 per element with 2x backward,
pooling/merges/elementwise 1x backward, no input gradient for the first layer).
"""
from __future__ import annotations

import os

import keras
import pytest

from planner.errors import PlannerError
from profiler.loader import ModelSource, build, load_model_source
from profiler.signature import model_signature
from profiler.static import profile_model, profile_source

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
F32 = 4  # bytes


def mlp_expected(n: int) -> dict[str, int]:
    """examples/mlp.py: 32 -> dense_1 64 relu -> dense_2 64 relu -> dense_3 10."""
    params = (32 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)          # 6922
    fwd = ((2 * 32 * 64 * n + 64 * n + 64 * n)      # dense_1: matmul + bias + relu
           + (2 * 64 * 64 * n + 64 * n + 64 * n)    # dense_2
           + (2 * 64 * 10 * n + 10 * n))            # dense_3: matmul + bias
    bwd = ((2 * 32 * 64 * n + 64 * n + 64 * n)      # dense_1: dW only (input is the model input)
           + (2 * (2 * 64 * 64 * n) + 64 * n + 64 * n)  # dense_2: dW + dX + dbias + relu'
           + (2 * (2 * 64 * 10 * n) + 10 * n))      # dense_3: dW + dX + dbias
    return {"params": params, "trainable_params": params, "param_bytes": params * F32,
            "flops_fwd": fwd, "flops_bwd": bwd,
            "activation_bytes": (64 + 64 + 10) * n * F32}


def cnn_expected(n: int) -> dict[str, int]:
    """examples/cnn.py, image 16x16x3 (see the module docstring for the layer table)."""
    conv1_macs = 3 * 3 * 3 * 16 * (16 * 16) * n     # kernel * Cin * Cout * output positions
    conv23_macs = 3 * 3 * 16 * 16 * (8 * 8) * n
    big, small = 16 * 16 * 16 * n, 8 * 8 * 16 * n   # elements of 16x16x16 and 8x8x16 maps
    params = ((3 * 3 * 3 * 16 + 16)                 # conv_1       448
              + 4 * 16                              # bn_1          64 (32 trainable)
              + 2 * (3 * 3 * 16 * 16 + 16)          # conv_2/3  2x2320
              + (16 * 10 + 10))                     # dense_1      170
    fwd = ((2 * conv1_macs + big + big)             # conv_1: conv + bias + relu
           + 7 * big                                # bn_1
           + 2 * 2 * small                          # pool_1: 2x2 window per output element
           + (2 * conv23_macs + small + small)      # conv_2: conv + bias + relu
           + (2 * conv23_macs + small)              # conv_3: conv + bias
           + small                                  # add_1: (2 - 1) per element
           + small                                  # relu_1
           + small                                  # gap: 1 per input element
           + (2 * 16 * 10 * n + 10 * n))            # dense_1
    bwd = ((2 * conv1_macs + big + big)             # conv_1: dW + dbias + relu' (no dX)
           + 2 * 7 * big                            # bn_1: 2x forward
           + 2 * 2 * small                          # pool_1: 1x forward
           + (2 * 2 * conv23_macs + small + small)  # conv_2: dW + dX + dbias + relu'
           + (2 * 2 * conv23_macs + small)          # conv_3: dW + dX + dbias
           + small + small + small                  # add_1, relu_1, gap: 1x forward
           + (2 * 2 * 16 * 10 * n + 10 * n))        # dense_1
    activations = (big + big + 5 * small + 16 * n + 10 * n) * F32
    return {"params": params, "trainable_params": params - 2 * 16,
            "param_bytes": params * F32, "flops_fwd": fwd, "flops_bwd": bwd,
            "activation_bytes": activations}


@pytest.fixture(scope="module")
def mlp_source() -> ModelSource:
    return load_model_source(os.path.join(EXAMPLES, "mlp.py"))


@pytest.fixture(scope="module")
def cnn_source() -> ModelSource:
    return load_model_source(os.path.join(EXAMPLES, "cnn.py"))


def totals(profile):
    t = profile.totals()
    return {k: t[k] for k in ("params", "trainable_params", "param_bytes", "flops_fwd",
                              "flops_bwd", "activation_bytes")}


@pytest.mark.parametrize("n", [1, 8])
def test_mlp_totals_by_hand(mlp_source, n):
    profile = profile_source(mlp_source, n)
    assert totals(profile) == mlp_expected(n)
    assert profile.batch_size == n and profile.model_name == "mlp"
    assert profile.optimizer == "adam" and profile.optimizer_slots_per_param == 2
    assert profile.totals()["optimizer_bytes"] == 6922 * 2 * F32
    assert profile.warnings == ()  # built in graph mode, optimizer from the file


@pytest.mark.parametrize("n", [1, 8])
def test_cnn_totals_by_hand(cnn_source, n):
    profile = profile_source(cnn_source, n)
    assert totals(profile) == cnn_expected(n)
    assert profile.totals()["grad_bytes"] == (5322 - 32) * F32  # moving stats get no grads
    assert profile.not_counted == ()


def test_batch_one_numbers_spelled_out(mlp_source, cnn_source):
    assert mlp_expected(1) == {"params": 6922, "trainable_params": 6922, "param_bytes": 27688,
                               "flops_fwd": 13834, "flops_bwd": 23306, "activation_bytes": 552}
    assert cnn_expected(1) == {"params": 5322, "trainable_params": 5290, "param_bytes": 21288,
                               "flops_fwd": 858442, "flops_bwd": 1477258,
                               "activation_bytes": 53352}


@pytest.mark.parametrize("example", ["mlp.py", "cnn.py"])
def test_params_and_signature_match_the_eager_model(example):
    source = load_model_source(os.path.join(EXAMPLES, example))
    model = build(source)  # eager: real weights
    profile = profile_model(model, 2, optimizer=source.optimizer)
    assert profile.params == model.count_params()
    assert profile.signature() == model_signature(model)
    assert totals(profile) == (mlp_expected if example == "mlp.py" else cnn_expected)(2)


def test_cnn_residual_edges_and_inputs(cnn_source):
    n = 8
    profile = profile_source(cnn_source, n)
    assert profile.layer("add_1").inputs == ("pool_1", "conv_3")
    assert profile.layer("conv_1").inputs == ()  # fed by the model input only
    into_add = {(e.src, e.bytes) for e in profile.edges if e.dst == "add_1"}
    assert into_add == {("pool_1", 8 * 8 * 16 * n * F32), ("conv_3", 8 * 8 * 16 * n * F32)}
    from_pool = sorted(e.dst for e in profile.edges if e.src == "pool_1")
    assert from_pool == ["add_1", "conv_2"]
    assert len(profile.edges) == 9  # 8 chain edges + the skip connection
    names = [l.name for l in profile.layers]
    assert names == ["conv_1", "bn_1", "pool_1", "conv_2", "conv_3", "add_1", "relu_1", "gap",
                     "dense_1"]
    for e in profile.edges:  # topological: every edge goes forward
        assert names.index(e.src) < names.index(e.dst)


def test_precision_changes_activation_bytes_not_variable_bytes(mlp_source):
    base = profile_source(mlp_source, 4)
    half = profile_source(mlp_source, 4, precision="mixed_float16")
    assert base.precision == "float32" and half.precision == "mixed_float16"
    assert half.activation_bytes * 2 == base.activation_bytes
    assert (half.param_bytes, half.totals()["grad_bytes"]) == (
        base.param_bytes, base.totals()["grad_bytes"])
    assert sum(e.bytes for e in half.edges) * 2 == sum(e.bytes for e in base.edges)
    with pytest.raises(PlannerError, match="float8"):
        profile_source(mlp_source, 4, precision="float8")
    with pytest.raises(PlannerError, match="batch_size"):
        profile_source(mlp_source, 0)


def test_model_built_under_mixed_policy_defaults_to_it():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inp = keras.Input((8,))
        model = keras.Model(inp, keras.layers.Dense(4, name="d")(inp))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    profile = profile_model(model, 3, optimizer="sgd")
    assert profile.precision == "mixed_bfloat16"
    assert profile.activation_bytes == 3 * 4 * 2  # bfloat16 output
    assert profile.param_bytes == (8 * 4 + 4) * 4  # float32 variables


def test_optimizer_choice_sets_slots_and_warns_when_guessed():
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(4)(inp))
    p = profile_model(model)
    assert (p.optimizer, p.optimizer_slots_per_param) == ("adam", 2)
    assert any("assuming adam" in w for w in p.warnings)
    p = profile_model(model, optimizer=keras.optimizers.SGD(momentum=0.9))
    assert (p.optimizer, p.optimizer_slots_per_param, p.warnings) == ("sgd", 1, ())
    assert p.totals()["optimizer_bytes"] == 36 * 1 * F32
    model.compile(optimizer=keras.optimizers.RMSprop(momentum=0.5, centered=True), loss="mse")
    assert profile_model(model).optimizer_slots_per_param == 3
    p = profile_model(model, optimizer="adafactor")
    assert p.optimizer_slots_per_param == 2 and any("adafactor" in w for w in p.warnings)


def test_layer_without_formula_shows_in_not_counted():
    class Doubler(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

    inp = keras.Input((8,))
    x = Doubler(name="doubler")(inp)
    model = keras.Model(inp, keras.layers.Dense(4, name="d")(x))
    p = profile_model(model, optimizer="sgd")
    assert p.layer("doubler").flops_fwd == 0
    assert p.not_counted == ("doubler: no FLOP formula for layer type Doubler",)
    # d's input comes from a layer without trainable weights fed by the model input:
    # no input gradient is needed there either.
    assert p.layer("d").flops_bwd == 2 * 8 * 4 + 4


def test_nested_model_is_one_layer_with_the_sum_of_its_inner_layers():
    def flat():
        inp = keras.Input((32,))
        x = keras.layers.Dense(64, activation="relu")(inp)
        x = keras.layers.Dense(10)(x)
        return keras.Model(inp, keras.layers.Dense(5)(x))

    inner_in = keras.Input((32,))
    inner = keras.Model(inner_in, keras.layers.Dense(10)(
        keras.layers.Dense(64, activation="relu")(inner_in)), name="trunk")
    inp = keras.Input((32,))
    nested = keras.Model(inp, keras.layers.Dense(5, name="head")(inner(inp)))
    p, q = profile_model(nested, 4, optimizer="sgd"), profile_model(flat(), 4, optimizer="sgd")
    assert [l.name for l in p.layers] == ["trunk", "head"]
    assert p.layer("trunk").params == inner.count_params()
    assert p.layer("head").inputs == ("trunk",)
    assert totals(p) == totals(q)


def test_sequential_and_keras_ops_outside_layers():
    seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="a"),
                            keras.layers.Dense(2, name="b")])
    p = profile_model(seq, optimizer="sgd")
    assert p.edges == (p.edges[0],) and (p.edges[0].src, p.edges[0].dst) == ("a", "b")
    inp = keras.Input((8,))
    x = keras.ops.relu(keras.layers.Dense(4, name="a")(inp))
    model = keras.Model(inp, keras.layers.Dense(2, name="b")(x))
    p = profile_model(model, optimizer="sgd")
    assert [(e.src, e.dst) for e in p.edges] == [("a", "b")]  # traced through the op
    assert any("outside any layer" in w and "relu" in w for w in p.warnings)


def test_graph_mode_falls_back_to_eager_with_a_warning():
    import tensorflow as tf

    def needs_eager():
        units = int(tf.constant(3).numpy())  # only works eagerly
        inp = keras.Input((units,))
        return keras.Model(inp, keras.layers.Dense(2)(inp))

    source = ModelSource("eager_only", needs_eager, None, "sgd", None, "test")
    with pytest.warns(RuntimeWarning, match="built eagerly"):
        p = profile_source(source)
    assert p.params == 8 and any("built eagerly" in w for w in p.warnings)


def test_mobilenetv2_loads_without_weights_and_profiles_in_graph_mode():
    source = load_model_source("keras.applications:MobileNetV2")
    profile = profile_source(source, 1)
    assert profile.params == 3538984
    assert not any("eagerly" in w for w in profile.warnings)
    assert profile.not_counted == ()
    assert profile.flops_fwd > 2 * 300_000_000  # ~300M multiply-adds in the paper
