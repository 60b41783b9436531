"""FLOP formulas: TensorFlow's own profiler agrees on Dense/Conv2D; other rules by hand."""
from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from profiler.layer_flops import layer_flops


def tf_profiler_flops(layer: keras.layers.Layer, input_shape: tuple[int, ...]) -> dict[str, int]:
    """TensorFlow's own float-operation count for one call of ``layer``, per graph op."""
    layer.build(input_shape)
    graph = tf.function(lambda x: layer(x)).get_concrete_function(
        tf.TensorSpec(input_shape, tf.float32)).graph
    opts = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    opts["output"] = "none"
    prof = tf.compat.v1.profiler.profile(graph, options=opts)
    ops = {c.name.split("/")[-1]: c.total_float_ops for c in prof.children}
    ops["total"] = prof.total_float_ops
    return ops


def test_dense_matmul_and_bias_match_tensorflow_profiler():
    n, k, u = 8, 32, 64
    tf_ops = tf_profiler_flops(keras.layers.Dense(u), (n, k))
    assert tf_ops["MatMul"] == 2 * n * k * u  # TF also counts 2 FLOPs per multiply-add
    assert tf_ops["BiasAdd"] == n * u
    ours = layer_flops(keras.layers.Dense(u), [(n, k)], [(n, u)], input_needs_grad=True)
    assert ours.fwd == tf_ops["total"] == 2 * n * k * u + n * u


def test_dense_relu_is_tensorflow_count_plus_one_per_output():
    # TF's profiler has no FLOP entry for Relu; we count 1 per output element on top.
    n, k, u = 4, 16, 24
    tf_ops = tf_profiler_flops(keras.layers.Dense(u, activation="relu"), (n, k))
    ours = layer_flops(keras.layers.Dense(u, activation="relu"), [(n, k)], [(n, u)],
                       input_needs_grad=True)
    assert ours.fwd == tf_ops["total"] + n * u


@pytest.mark.parametrize("strides,padding,out_hw", [(1, "same", 16), (2, "valid", 7)])
def test_conv2d_matches_tensorflow_profiler(strides, padding, out_hw):
    n, hw, cin, cout, k = 2, 16, 3, 8, 3
    make = lambda: keras.layers.Conv2D(cout, k, strides=strides, padding=padding)  # noqa: E731
    tf_ops = tf_profiler_flops(make(), (n, hw, hw, cin))
    conv_flops = 2 * k * k * cin * cout * out_hw * out_hw * n
    assert tf_ops["convolution"] == conv_flops
    assert tf_ops["total"] == conv_flops + n * out_hw * out_hw * cout  # + BiasAdd
    ours = layer_flops(make(), [(n, hw, hw, cin)], [(n, out_hw, out_hw, cout)],
                       input_needs_grad=True)
    assert ours.fwd == tf_ops["total"]


def test_weighted_backward_skips_input_gradient_only_when_not_needed():
    dense = keras.layers.Dense(10, activation="relu")
    dense.build((None, 20))
    n = 3
    matmul = 2 * n * 20 * 10
    first = layer_flops(dense, [(n, 20)], [(n, 10)], input_needs_grad=False)
    later = layer_flops(dense, [(n, 20)], [(n, 10)], input_needs_grad=True)
    assert first.bwd == matmul + n * 10 + n * 10            # dW + dbias + relu'
    assert later.bwd == matmul + matmul + n * 10 + n * 10   # dW + dX + dbias + relu'
    dense.trainable = False
    frozen = layer_flops(dense, [(n, 20)], [(n, 10)], input_needs_grad=True)
    assert frozen.bwd == matmul + n * 10                    # dX + relu' only
    assert layer_flops(dense, [(n, 20)], [(n, 10)], input_needs_grad=False).bwd == 0


def test_depthwise_and_separable_conv():
    n, hw, cin, dm, cout = 2, 8, 4, 2, 6
    dw = keras.layers.DepthwiseConv2D(3, depth_multiplier=dm, padding="same")
    dw.build((None, hw, hw, cin))
    out_el = n * hw * hw * cin * dm
    f = layer_flops(dw, [(n, hw, hw, cin)], [(n, hw, hw, cin * dm)], input_needs_grad=True)
    assert f.fwd == 2 * 9 * out_el + out_el
    assert f.bwd == 2 * 9 * out_el * 2 + out_el
    sep = keras.layers.SeparableConv2D(cout, 3, depth_multiplier=dm, padding="same")
    sep.build((None, hw, hw, cin))
    pos = n * hw * hw
    depthwise, pointwise = 9 * cin * dm * pos, cin * dm * cout * pos
    f = layer_flops(sep, [(n, hw, hw, cin)], [(n, hw, hw, cout)], input_needs_grad=False)
    assert f.fwd == 2 * (depthwise + pointwise) + cout * pos
    # both weight gradients + gradient into the depthwise output; no dX
    assert f.bwd == 2 * (depthwise + pointwise) + 2 * pointwise + cout * pos


def test_pooling_normalization_softmax_merge_rules():
    n = 2
    pool = keras.layers.AveragePooling2D(2)
    f = layer_flops(pool, [(n, 8, 8, 3)], [(n, 4, 4, 3)], input_needs_grad=True)
    assert (f.fwd, f.bwd) == (4 * n * 4 * 4 * 3, 4 * n * 4 * 4 * 3)
    gmp = keras.layers.GlobalMaxPooling1D()
    f = layer_flops(gmp, [(n, 10, 5)], [(n, 5)], input_needs_grad=False)
    assert (f.fwd, f.bwd) == (n * 10 * 5, 0)
    ln = keras.layers.LayerNormalization()
    ln.build((None, 6))
    f = layer_flops(ln, [(n, 6)], [(n, 6)], input_needs_grad=True)
    assert (f.fwd, f.bwd) == (7 * n * 6, 2 * 7 * n * 6)
    ln_plain = keras.layers.LayerNormalization(center=False, scale=False)
    ln_plain.build((None, 6))
    assert layer_flops(ln_plain, [(n, 6)], [(n, 6)], input_needs_grad=True).fwd == 5 * n * 6
    sm = keras.layers.Softmax()
    f = layer_flops(sm, [(n, 6)], [(n, 6)], input_needs_grad=True)
    assert (f.fwd, f.bwd) == (5 * n * 6, 4 * n * 6)
    add3 = keras.layers.Add()
    f = layer_flops(add3, [(n, 6)] * 3, [(n, 6)], input_needs_grad=True)
    assert (f.fwd, f.bwd) == (2 * n * 6, 2 * n * 6)
    for zero in (keras.layers.Flatten(), keras.layers.Dropout(0.5), keras.layers.Reshape((6,))):
        f = layer_flops(zero, [(n, 6)], [(n, 6)], input_needs_grad=True)
        assert (f.fwd, f.bwd, f.not_counted) == (0, 0, ())


class Doubler(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


class MyDense(keras.layers.Dense):
    def call(self, x):  # overrides call: we cannot know what it computes
        return super().call(x) * 2.0


class RenamedDense(keras.layers.Dense):
    pass  # inherits call: Dense's formula applies


def test_layers_without_formula_are_listed_never_silently_zero():
    f = layer_flops(Doubler(), [(2, 3)], [(2, 3)], input_needs_grad=True)
    assert (f.fwd, f.bwd) == (0, 0)
    assert f.not_counted == ("no FLOP formula for layer type Doubler",)
    mine = MyDense(4)
    mine.build((None, 3))
    assert layer_flops(mine, [(2, 3)], [(2, 4)], input_needs_grad=True).not_counted
    renamed = RenamedDense(4)
    renamed.build((None, 3))
    f = layer_flops(renamed, [(2, 3)], [(2, 4)], input_needs_grad=True)
    assert f.fwd == 2 * 2 * 3 * 4 + 2 * 4 and f.not_counted == ()
    custom_act = keras.layers.Dense(4, activation=lambda x: x * 3.0)
    custom_act.build((None, 3))
    f = layer_flops(custom_act, [(2, 3)], [(2, 4)], input_needs_grad=True)
    assert f.fwd == 2 * 2 * 3 * 4 + 2 * 4  # matmul + bias; the activation is listed instead
    assert len(f.not_counted) == 1 and "activation" in f.not_counted[0]
