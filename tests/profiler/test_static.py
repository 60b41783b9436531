"""Static profiles of the example models and small graphs, checked against numbers by hand.

Every expected number below is written out from the architecture, the ops
Keras 3 emits for it on TensorFlow (a training step: ``training=True``, then
``tf.gradients`` of the summed outputs) and the per-op conventions of
``profiler.op_flops``: 2 FLOPs per multiply-add; BiasAdd, ReLU and other
elementwise ops 1 per output element; reductions (Sum, BiasAddGrad) in - out
additions, Mean 1 per input element; MaxPool kernel area per output element,
MaxPoolGrad that plus 1 per output; AddN (k-1) per element. Gradient ops that
TensorFlow never runs (the input gradient of a layer fed by the model input)
are not counted.
"""
from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan.core.errors import PlannerError
from tfplan.profiler.loader import ModelSource, build, load_model_source
from tfplan.profiler.model_profile import ModelProfile
from tfplan.profiler.repeats import find_repeats
from tfplan.profiler.signature import model_signature
from tfplan.profiler.static import profile_model, profile_source

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
F32 = 4  # bytes


def mlp_expected(n: int) -> dict[str, int]:
    """examples/mlp.py: 32 -> dense_1 64 relu -> dense_2 64 relu -> dense_3 10."""
    params = (32 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)          # 6922
    fwd = ((2 * 32 * 64 * n + 64 * n + 64 * n)      # dense_1: MatMul + BiasAdd + Relu
           + (2 * 64 * 64 * n + 64 * n + 64 * n)    # dense_2
           + (2 * 64 * 10 * n + 10 * n))            # dense_3: MatMul + BiasAdd
    bwd = ((64 * n + (64 * n - 64) + 2 * 32 * 64 * n)          # dense_1: ReluGrad, BiasAddGrad,
           #                                                     dW (no dX: model input)
           + (64 * n + (64 * n - 64) + 2 * (2 * 64 * 64 * n))  # dense_2: + dW + dX
           + ((10 * n - 10) + 2 * (2 * 64 * 10 * n)))          # dense_3: BiasAddGrad, dW, dX
    return {"params": params, "trainable_params": params, "param_bytes": params * F32,
            "flops_fwd": fwd, "flops_bwd": bwd,
            "activation_bytes": (64 + 64 + 10) * n * F32,
            # relu outputs of dense_1/dense_2 (read by ReluGrad and the next dW); the model
            # input (read by dense_1's dW) travels on its input edge instead
            "activation_saved_bytes": (64 + 64) * n * F32,
            "input_bytes": (32 + 64 + 64) * n * F32}


def cnn_expected(n: int) -> dict[str, int]:
    """examples/cnn.py, image 16x16x3 (see the module docstring for the layer table)."""
    c = 16
    conv1 = 2 * 3 * 3 * 3 * 16 * (16 * 16) * n       # Conv2D: 2 * kernel * Cin * Cout * positions
    conv23 = 2 * 3 * 3 * 16 * 16 * (8 * 8) * n
    big, small = 16 * 16 * 16 * n, 8 * 8 * 16 * n     # elements of 16x16x16 and 8x8x16 maps
    params = ((3 * 3 * 3 * 16 + 16)                   # conv_1       448
              + 4 * 16                                # bn_1          64 (32 trainable)
              + 2 * (3 * 3 * 16 * 16 + 16)            # conv_2/3  2x2320
              + (16 * 10 + 10))                       # dense_1      170
    # bn_1, training mode, as Keras emits it (tf.nn.moments + batch_normalization):
    #   per element: Mean (1) + SquaredDifference (2) + Mean (1) + Mul (1) + AddV2 (1) = 6;
    #   per channel: moving mean and variance updates 2 x (Mul, Mul, AddV2) = 6, then
    #   AddV2 eps (1) + Rsqrt (2) + Mul gamma (1) + Mul mean (1) + Sub beta (1) = 6.
    bn_fwd = 6 * big + 12 * c
    # its gradient: per element Sum x2, Mul x2, RealDiv x2, SquaredDifference's Mul/Sub/Mul,
    #   and AddN over the three paths into its input (2): 11, the two Sums less c each;
    #   per channel Neg, Mul x4, AddN (2 inputs), RsqrtGrad (4) = 10.
    bn_bwd = 11 * big - 2 * c + 10 * c
    fwd = ((conv1 + big + big)                        # conv_1: Conv2D + BiasAdd + Relu
           + bn_fwd
           + 4 * small                                # pool_1: MaxPool, 2x2 window
           + (conv23 + small + small)                 # conv_2: Conv2D + BiasAdd + Relu
           + (conv23 + small)                         # conv_3: Conv2D + BiasAdd
           + small                                    # add_1: AddV2
           + small                                    # relu_1
           + small                                    # gap: Mean, 1 per input element
           + (2 * 16 * 10 * n + 10 * n))              # dense_1: MatMul + BiasAdd
    bwd = ((big + (big - c) + conv1)                  # conv_1: ReluGrad, BiasAddGrad, dW only
           + bn_bwd
           + (small + 4 * small + small)              # pool_1: AddN (residual) + MaxPoolGrad
           + (small + (small - c) + 2 * conv23)       # conv_2: ReluGrad, BiasAddGrad, dX, dW
           + ((small - c) + 2 * conv23)               # conv_3: BiasAddGrad, dX, dW
           + 0                                        # add_1: the gradient passes through
           + small + small                            # relu_1: ReluGrad; gap: RealDiv
           + ((10 * n - 10) + 2 * 2 * 16 * 10 * n))   # dense_1: BiasAddGrad, dX, dW
    activations = (big + big + 5 * small + 16 * n + 10 * n) * F32
    saved = (big                                      # conv_1's relu output
             + big + 3 * c                            # bn_1's output; mean, 1/std, gamma/std
             + small + small                          # pool_1 output (MaxPoolGrad), conv_2 relu
             + small + 16 * n) * F32                  # relu_1 output, gap output (dense dW)
    return {"params": params, "trainable_params": params - 2 * 16,
            "param_bytes": params * F32, "flops_fwd": fwd, "flops_bwd": bwd,
            "activation_bytes": activations, "activation_saved_bytes": saved,
            # conv_1 the image; bn_1, pool_1 a 16x16x16 map; conv_2, conv_3 one 8x8x16 map,
            # add_1 two, relu_1 and gap one; dense_1 16 features
            "input_bytes": (16 * 16 * 3 * n + 2 * big + 2 * small + 2 * small + 2 * small
                            + 16 * n) * F32}


@pytest.fixture(scope="module")
def mlp_source() -> ModelSource:
    return load_model_source(os.path.join(EXAMPLES, "mlp.py"))


@pytest.fixture(scope="module")
def cnn_source() -> ModelSource:
    return load_model_source(os.path.join(EXAMPLES, "cnn.py"))


def totals(profile):
    t = profile.totals()
    return {k: t[k] for k in ("params", "trainable_params", "param_bytes", "flops_fwd",
                              "flops_bwd", "activation_bytes", "activation_saved_bytes",
                              "input_bytes")}


@pytest.mark.parametrize("n", [1, 8])
def test_mlp_totals_by_hand(mlp_source, n):
    profile = profile_source(mlp_source, n)
    assert totals(profile) == mlp_expected(n)
    assert profile.batch_size == n and profile.model_name == "mlp"
    assert profile.optimizer == "adam" and profile.optimizer_slots_per_param == 2
    assert profile.totals()["optimizer_bytes"] == 6922 * 2 * F32
    assert profile.totals()["compute_weight_bytes"] == 0  # float32: no compute copies
    assert profile.warnings == ()  # built in graph mode, optimizer from the file
    assert profile.layer("dense_2").flops_bwd == 64 * n + 64 * n - 64 + 4 * 64 * 64 * n


@pytest.mark.parametrize("n", [1, 8])
def test_cnn_totals_by_hand(cnn_source, n):
    profile = profile_source(cnn_source, n)
    assert totals(profile) == cnn_expected(n)
    assert profile.totals()["grad_bytes"] == (5322 - 32) * F32  # moving stats get no grads
    assert profile.totals()["non_trainable_params"] == 32
    assert profile.layer("bn_1").trainable_param_bytes == 32 * F32
    assert profile.not_counted == ()
    assert profile.layer("add_1").flops_bwd == 0 and profile.layer("add_1").input_bytes == \
        2 * 8 * 8 * 16 * n * F32


def test_batch_one_numbers_spelled_out():
    # Changed from the layer-level formulas: BiasAddGrad is a reduction, N*U - U additions
    # (not N*U); batch normalization is its ops (6/element + per channel, gradient 11/element)
    # instead of "7 per element, 2x backward"; MaxPoolGrad is 5 per output.
    assert {k: mlp_expected(1)[k] for k in ("flops_fwd", "flops_bwd")} == {
        "flops_fwd": 13834, "flops_bwd": 23168}
    assert {k: cnn_expected(1)[k] for k in ("params", "flops_fwd", "flops_bwd",
                                            "activation_bytes")} == {
        "params": 5322, "flops_fwd": 854538, "flops_bwd": 1466064, "activation_bytes": 53352}


@pytest.mark.parametrize("example", ["mlp.py", "cnn.py"])
def test_params_and_signature_match_the_eager_model(example):
    source = load_model_source(os.path.join(EXAMPLES, example))
    model = build(source)  # eager: real weights; the step is traced in a tf.function
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
    assert len(profile.edges) == 10  # the input edge, 8 chain edges, the skip connection
    assert [(e.src, e.dst, e.bytes) for e in profile.edges if e.src == "image"] == [
        ("image", "conv_1", 16 * 16 * 3 * n * F32)]
    names = [l.name for l in profile.layers]
    assert names == ["conv_1", "bn_1", "pool_1", "conv_2", "conv_3", "add_1", "relu_1", "gap",
                     "dense_1"]
    for e in profile.edges:  # topological: every edge goes forward
        assert e.src == "image" or names.index(e.src) < names.index(e.dst)


def test_precision_builds_under_the_policy(mlp_source):
    base = profile_source(mlp_source, 4)
    half = profile_source(mlp_source, 4, precision="mixed_float16")
    assert keras.config.dtype_policy().name == "float32"  # restored
    assert base.precision == "float32" and half.precision == "mixed_float16"
    assert half.activation_bytes * 2 == base.activation_bytes
    assert (half.param_bytes, half.totals()["grad_bytes"]) == (
        base.param_bytes, base.totals()["grad_bytes"])  # float32 master weights and grads
    # Dense casts kernel and bias to float16 for compute: a 2-byte copy of every weight
    assert half.totals()["compute_weight_bytes"] == 6922 * 2
    assert half.layer("dense_1").state_bytes == base.layer("dense_1").state_bytes + \
        (32 * 64 + 64) * 2
    layer_edges = lambda p: sum(e.bytes for e in p.edges if e.src != "features")  # noqa: E731
    assert layer_edges(half) * 2 == layer_edges(base)
    assert (half.flops_fwd, half.flops_bwd) == (base.flops_fwd, base.flops_bwd)
    with pytest.raises(PlannerError, match="float8"):
        profile_source(mlp_source, 4, precision="float8")
    with pytest.raises(PlannerError, match="batch_size"):
        profile_source(mlp_source, 0)


def test_precision_override_on_a_built_model_estimates_and_says_so(mlp_source):
    with tf.Graph().as_default():
        model = build(mlp_source)
        estimated = profile_model(model, 4, precision="mixed_float16", optimizer="adam")
    exact = profile_source(mlp_source, 4, precision="mixed_float16")
    for k in ("activation_bytes", "compute_weight_bytes", "param_bytes", "flops_fwd"):
        assert estimated.totals()[k] == exact.totals()[k], k
    # built under the policy, dense_1 casts the float32 input to float16 and keeps the copy
    # for its weight gradient; the estimate cannot know about that cast
    assert exact.activation_saved_bytes == estimated.activation_saved_bytes + 4 * 32 * 2
    assert any("estimated" in w for w in estimated.warnings)


def test_model_built_under_mixed_policy_defaults_to_it():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inp = keras.Input((8,))
        x = keras.layers.LayerNormalization(name="ln")(inp)  # computes in float32, no casts
        model = keras.Model(inp, keras.layers.Dense(4, name="d")(x))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    profile = profile_model(model, 3, optimizer="sgd")
    assert profile.precision == "mixed_bfloat16"
    d = profile.layer("d")
    assert d.activation_bytes == 3 * 4 * 2  # bfloat16 output
    assert d.param_bytes == (8 * 4 + 4) * 4  # float32 variables
    assert d.compute_weight_bytes == (8 * 4 + 4) * 2  # their bfloat16 copies
    assert profile.layer("ln").compute_weight_bytes == 0


class Toy(keras.Model):
    """A subclassed model with a kernel of rank 3 (Adafactor factors it) and 1-D weights."""


def toy_model() -> keras.Model:
    inp = keras.Input((6, 8))
    x = keras.layers.EinsumDense("abc,cde->abde", (6, 4, 5), bias_axes="de", name="ed")(inp)
    x = keras.layers.Reshape((6, 20))(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    return keras.Model(inp, keras.layers.Dense(3, name="d")(x))


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.SGD(), lambda: keras.optimizers.SGD(momentum=0.9),
    lambda: keras.optimizers.Adam(), lambda: keras.optimizers.AdamW(amsgrad=True),
    lambda: keras.optimizers.RMSprop(momentum=0.5, centered=True),
    lambda: keras.optimizers.Adafactor(), lambda: keras.optimizers.Adagrad(),
    lambda: keras.optimizers.Nadam(), lambda: keras.optimizers.Lion(),
    lambda: keras.optimizers.Muon(), lambda: keras.optimizers.Lamb(),
    lambda: keras.optimizers.Adadelta(), lambda: keras.optimizers.Ftrl(),
])
def test_optimizer_bytes_equal_what_keras_allocates(make):
    model = toy_model()
    profile = profile_model(model, optimizer=make())
    built = make()
    built.build(model.trainable_variables)
    global_scalars = {id(built.iterations), id(built._learning_rate)}
    global_scalars.add(id(getattr(built, "_u_product", None)))  # Nadam's
    allocated = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                    for v in built.variables if id(v) not in global_scalars)
    assert profile.totals()["optimizer_bytes"] == allocated
    assert profile.warnings == ()


def test_optimizer_names_and_guesses():
    model = toy_model()
    p = profile_model(model)
    assert (p.optimizer, p.optimizer_slots_per_param) == ("adam", 2)
    assert any("assuming adam" in w for w in p.warnings)
    model.compile(optimizer=keras.optimizers.RMSprop(momentum=0.5, centered=True), loss="mse")
    assert profile_model(model).optimizer_slots_per_param == 3
    p = profile_model(model, optimizer="adafactor")
    assert (p.optimizer, p.optimizer_slots_per_param, p.warnings) == ("adafactor", 1, ())
    # EinsumDense kernel (8, 4, 5): velocity 160 + rows (8, 4) 32 + columns (8, 5) 40;
    # bias (4, 5): velocity 20 + rows 4 + columns 5
    assert p.layer("ed").optimizer_bytes == (160 + 32 + 40 + 20 + 4 + 5) * F32
    # LayerNormalization gamma and beta (20,): velocity and two int32 scalar placeholders each
    assert p.layer("ln").optimizer_bytes == 2 * (20 * F32 + 2 * 4)
    # a name no one knows is an error naming the known ones (Keras refuses it too) ...
    with pytest.raises(PlannerError, match="'novograd' is not one the profiler knows.*adam"):
        profile_model(model, optimizer="novograd")

    # ... while an optimizer object of another class counts Adam's 2 slots, with a warning
    class NovoGrad(keras.optimizers.SGD):
        pass

    p = profile_model(model, optimizer=NovoGrad())
    assert p.optimizer_slots_per_param == 2 and any("NovoGrad" in w for w in p.warnings)


def test_unknown_op_shows_in_not_counted():
    class Det(keras.layers.Layer):
        def call(self, x):
            return tf.linalg.det(x)[..., None] * x[..., 0, :]

    inp = keras.Input((3, 3))
    x = keras.layers.Dense(3, name="d")(inp)
    model = keras.Model(inp, Det(name="det")(x))
    p = profile_model(model, 2, optimizer="sgd")
    det = p.layer("det")
    assert any(w.endswith("(MatrixDeterminant)") and "/det" in w for w in det.not_counted)
    assert p.not_counted and all(w.startswith("det: ") for w in p.not_counted)
    assert det.flops_fwd == 2 * 3  # what has a formula still counts: the Mul of (2, 3)


def test_nested_models_are_flattened_to_their_layers():
    def flat():
        inp = keras.Input((32,))
        x = keras.layers.Dense(64, activation="relu")(inp)
        x = keras.layers.Dense(10)(x)
        return keras.Model(inp, keras.layers.Dense(5)(x))

    inner_in = keras.Input((32,))
    inner = keras.Model(inner_in, keras.layers.Dense(10, name="out")(
        keras.layers.Dense(64, activation="relu", name="hidden")(inner_in)), name="trunk")
    inp = keras.Input((32,))
    nested = keras.Model(inp, keras.layers.Dense(5, name="head")(inner(inp)))
    p, q = profile_model(nested, 4, optimizer="sgd"), profile_model(flat(), 4, optimizer="sgd")
    assert [l.name for l in p.layers] == ["trunk/hidden", "trunk/out", "head"]
    assert p.signature() == model_signature(nested)
    assert p.layer("trunk/out").inputs == ("trunk/hidden",)
    assert p.layer("head").inputs == ("trunk/out",)
    assert totals(p) == totals(q)
    assert [l.flops_fwd for l in p.layers] == [l.flops_fwd for l in q.layers]


def test_shared_layer_is_one_node_with_its_calls_summed():
    shared = keras.layers.Dense(8, name="blk")
    inp = keras.Input((8,))
    y = keras.layers.Dense(8, name="blk_1")(shared(shared(inp)))  # TF would name scopes blk_1..
    model = keras.Model(inp, y)
    p = profile_model(model, 2, optimizer="sgd")
    assert [(l.name, l.calls) for l in p.layers] == [("blk", 2), ("blk_1", 1)]
    one_call = 2 * 2 * 8 * 8 + 2 * 8  # MatMul + BiasAdd
    assert p.layer("blk").flops_fwd == 2 * one_call
    assert p.layer("blk_1").flops_fwd == one_call
    # backward of blk: call 2 dW+dX, call 1 dW only (fed by the input); bias grads; and the
    # AddN of the two calls' weight gradients (64 + 8)
    bias_grad = 2 * 8 - 8
    assert p.layer("blk").flops_bwd == 3 * (2 * 2 * 8 * 8) + 2 * bias_grad + (64 + 8)
    assert p.layer("blk").activation_bytes == 2 * (2 * 8 * F32)
    assert p.layer("blk_1").inputs == ("blk",)


def test_sequential_and_keras_ops_outside_layers():
    seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="a"),
                            keras.layers.Dense(2, name="b")])
    p = profile_model(seq, optimizer="sgd")
    assert [(e.src, e.dst) for e in p.edges if e.src in ("a", "b")] == [("a", "b")]
    inp = keras.Input((8,))
    x = keras.ops.relu(keras.layers.Dense(4, name="a")(inp))
    model = keras.Model(inp, keras.layers.Dense(2, name="b")(x))
    p = profile_model(model, optimizer="sgd")
    assert [(e.src, e.dst) for e in p.edges if e.src == "a"] == [("a", "b")]  # through relu
    assert any("outside any layer" in w and "relu" in w and "Relu" in w for w in p.warnings)


def test_subclassed_model_groups_ops_by_its_sub_layers(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.first = keras.layers.Dense(6, name="first")
            self.second = keras.layers.Dense(3, name="second")

        def call(self, x):
            return self.second(self.first(x) * 2.0)

    model = Net()
    model(np.zeros((1, 5), np.float32))
    p = profile_model(model, 2, optimizer="sgd", input_example=np.zeros((1, 5), np.float32))
    assert [l.name for l in p.layers] == ["first", "second"]
    assert p.layer("first").flops_fwd == 2 * 2 * 5 * 6 + 2 * 6
    assert p.layer("second").flops_fwd == 2 * 2 * 6 * 3 + 2 * 3
    assert any("subclassed" in w for w in p.warnings)
    assert any("outside any layer" in w and "Mul" in w for w in p.warnings)  # the * 2.0
    with pytest.raises(PlannerError, match="input_example.*sample_batch"):
        profile_model(model)


def test_graph_mode_falls_back_to_eager_with_a_warning():
    def needs_eager():
        units = int(tf.constant(3).numpy())  # only works eagerly
        inp = keras.Input((units,))
        return keras.Model(inp, keras.layers.Dense(2)(inp))

    source = ModelSource("eager_only", needs_eager, None, "sgd", None, "test")
    with pytest.warns(RuntimeWarning, match="built eagerly"):
        p = profile_source(source)
    assert p.params == 8 and any("built eagerly" in w for w in p.warnings)


def test_input_with_unknown_dimensions_is_refused_with_the_fix():
    inp = keras.Input((None, 8), name="tokens")
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    with pytest.raises(PlannerError, match="'tokens' has shape \\(None, None, 8\\).*fixed"):
        profile_model(model, optimizer="sgd")


def test_progress_reports_each_stage(mlp_source):
    seen = []
    profile_source(mlp_source, 2, progress=lambda *a: seen.append(a))
    stages = [s for s, _, _ in seen]
    assert stages[0] == "build" and "trace" in stages and "gradients" in stages
    assert stages[-1] == "count"
    for stage in ("build", "trace", "gradients", "count"):
        last = [(d, t) for s, d, t in seen if s == stage][-1]
        assert last[0] == last[1] > 0  # each stage ends complete
    assert [(d, t) for s, d, t in seen if s == "trace"] == [(1, 3), (2, 3), (3, 3)]


def gpt(layers=6, hidden=32, heads=4, vocab=50, seq=8, tap_after=None, join_after=None):
    """A small GPT (benchmarks/profile_gpt.build_gpt), optionally with a skip connection."""
    from benchmarks.profile_gpt import build_gpt

    return build_gpt(layers, hidden, heads, vocab, seq, tap_after=tap_after,
                     join_after=join_after)


def test_repeated_blocks_traced_once_give_the_same_profile():
    with tf.Graph().as_default():
        model = gpt()
        runs = find_repeats(model)
        full = profile_model(model, 2, optimizer="adam", repeat_blocks=False)
        fast = profile_model(model, 2, optimizer="adam", repeat_blocks=True)
    assert len(runs) == 1 and len(runs[0].blocks) == 6 and runs[0].blocks[0][0] == "ln1_0"
    assert fast.layers == full.layers
    assert sorted(fast.edges, key=repr) == sorted(full.edges, key=repr)
    assert any("6 identical blocks of 7 layers" in w for w in fast.warnings)
    assert not any("identical blocks" in w for w in full.warnings)


def test_repeats_only_where_the_wiring_repeats():
    with tf.Graph().as_default():
        # embedding -> after block 4: blocks 0-4 still repeat (the skip leaves from before
        # them and joins after the last of them)
        model = gpt(layers=5, tap_after=-1, join_after=4)
        runs = find_repeats(model)
        assert [(r.blocks[0][0], r.blocks[-1][-1]) for r in runs] == [("ln1_0", "res2_4")]
        fast = profile_model(model, optimizer="sgd", repeat_blocks=True)
        assert fast.layers == profile_model(model, optimizer="sgd", repeat_blocks=False).layers
        # block 0's output read after block 5: block 0 is no ordinary first block
        assert find_repeats(gpt(layers=5, tap_after=0, join_after=4)) == []
        assert find_repeats(gpt(layers=3)) == []  # fewer than 4 blocks: nothing to gain


def test_profile_json_round_trip_with_new_fields(cnn_source):
    profile = profile_source(cnn_source, 2)
    doc = json.loads(json.dumps(profile.to_dict()))
    layer = doc["layers"][1]
    for key in ("trainable_param_bytes", "compute_weight_bytes", "activation_saved_bytes",
                "input_bytes", "calls", "non_trainable_params"):
        assert key in layer and key in doc["totals"] or key == "calls"
    back = ModelProfile.from_dict(doc)
    assert back.layers == profile.layers and back.edges == profile.edges
    for l in doc["layers"]:  # a profile written before these fields existed still loads
        for key in ("trainable_param_bytes", "compute_weight_bytes", "activation_saved_bytes",
                    "input_bytes", "calls", "non_trainable_params"):
            l.pop(key)
    old = ModelProfile.from_dict(doc)
    assert old.layer("bn_1").trainable_param_bytes == old.layer("bn_1").grad_bytes
    assert old.layer("bn_1").calls == 1 and old.activation_saved_bytes == 0


def test_mlp_contraction_flops_and_memory_traffic_by_hand(mlp_source):
    n = 256
    layers = {l.name: l for l in profile_source(mlp_source, n).layers}
    shapes = {"dense_1": (32, 64), "dense_2": (64, 64), "dense_3": (64, 10)}
    for name, (fan_in, fan_out) in shapes.items():
        l = layers[name]
        assert l.has_op_classes
        # MatMul forward 2*n*in*out; backward: the weight gradient, and the input gradient
        # except for dense_1, whose input (the model input) needs none
        assert l.matmul_flops_fwd == 2 * n * fan_in * fan_out
        assert l.matmul_flops_bwd == (2 if name == "dense_1" else 4) * n * fan_in * fan_out
        assert 0 < l.flops_fwd - l.matmul_flops_fwd < l.matmul_flops_fwd  # bias, relu
    # dense_1 forward, float32: BiasAdd reads x [n,64] and the bias, writes [n,64]; Relu
    # reads and writes [n,64]; MatMul and the variable reads move nothing counted here
    out = n * 64 * 4
    assert layers["dense_1"].memory_traffic_bytes_fwd == 3 * out + 64 * 4 + out
    # dense_3 has no activation: its BiasAdd alone
    assert layers["dense_3"].memory_traffic_bytes_fwd == 2 * n * 10 * 4 + 10 * 4


def test_profiles_saved_before_the_op_classes_still_load():
    from tfplan.profiler.model_profile import LayerProfile
    d = {"name": "d", "type": "Dense", "params": 10, "trainable_params": 10,
         "param_bytes": 40, "grad_bytes": 40, "optimizer_bytes": 80,
         "activation_bytes": 8, "flops_fwd": 40, "flops_bwd": 80}
    layer = LayerProfile.from_dict(d)
    assert (layer.matmul_flops_fwd, layer.memory_traffic_bytes_bwd) == (0, 0)
    assert not layer.has_op_classes  # priced as all contractions by the cost model
    assert LayerProfile.from_dict(layer.to_dict()) == layer
