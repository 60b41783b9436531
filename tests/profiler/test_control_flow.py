"""While loops and function calls are counted from their bodies (profiler.control_flow).

Conventions checked here (profiler.op_flops and profiler.control_flow): a While loop's
body ops count once per iteration and its condition's once per test (trips + 1); an
LSTM cell step on a batch B with input width I and U units is, in TensorFlow ops:

* matmuls: x @ W (2 B I 4U) and h @ R (2 B U 4U);
* elementwise: the Add of the two (4BU), BiasAdd (4BU), 3 Sigmoid, 2 Tanh, 3 Mul and
  the cell-state Add (1 BU each): 17 BU;
* loop control: the loop counter's and the time step's increments (2 scalar Adds);

and the condition (time < T and counter < maximum_iterations) is 3 scalar ops.
"""
from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from tfplan.profiler.static import profile_and_trace

B, T, I, U = 2, 10, 8, 16


def _profile(make, shape=(T, I)):
    with tf.Graph().as_default():
        x = keras.Input(shape, name="x")
        model = keras.Model(x, make(x))
        return profile_and_trace(model, B, optimizer="sgd")


def _layer(profile, name):
    return profile.layer(name)


def test_lstm_forward_matches_the_closed_form_and_backward_is_twice_its_matmuls():
    profile, _ = _profile(lambda x: keras.layers.LSTM(U, name="lstm")(x))
    lstm = profile.layer("lstm")
    matmul_step = 2 * B * 4 * U * (I + U)  # 2*4*(I*U + U*U) per sample
    assert lstm.matmul_flops_fwd == T * matmul_step
    assert lstm.flops_fwd == T * (matmul_step + 17 * B * U + 2) + 3 * (T + 1)
    # backward: dx, dW, dh, dR, each as many multiply-adds as a forward matmul
    assert lstm.matmul_flops_bwd == 2 * lstm.matmul_flops_fwd
    assert lstm.flops_bwd > lstm.matmul_flops_bwd
    assert lstm.not_counted == ()
    assert not [w for w in profile.warnings if "While" in w]


def test_lstm_flops_grow_linearly_with_the_sequence_length():
    short, _ = _profile(lambda x: keras.layers.LSTM(U, name="lstm")(x), (5, I))
    long, _ = _profile(lambda x: keras.layers.LSTM(U, name="lstm")(x), (20, I))
    s, l = short.layer("lstm"), long.layer("lstm")
    assert l.matmul_flops_fwd == 4 * s.matmul_flops_fwd
    assert l.matmul_flops_bwd == 4 * s.matmul_flops_bwd
    # kept for the backward pass, per step: the 3 sigmoid and 2 tanh outputs, the states
    # c and h before the step and the input x_t (float32), and 16 bytes of TensorList
    # bookkeeping (an element shape, a length, a scalar); the weights it reads are not
    # copies (the variables' own buffers)
    per_step = 4 * (7 * B * U + B * I) + 16
    assert l.activation_saved_bytes - s.activation_saved_bytes == 15 * per_step
    assert s.activation_saved_bytes >= 5 * per_step


@pytest.mark.parametrize("cls,gates", [(keras.layers.GRU, 3), (keras.layers.SimpleRNN, 1)])
def test_gru_and_simple_rnn_matmuls(cls, gates):
    profile, _ = _profile(lambda x: cls(U, name="rnn")(x))
    rnn = profile.layer("rnn")
    assert rnn.matmul_flops_fwd == T * 2 * B * gates * U * (I + U)
    assert rnn.matmul_flops_bwd == 2 * rnn.matmul_flops_fwd
    assert rnn.not_counted == ()


class _Scan(keras.layers.Layer):
    """h_t = tanh(h_{t-1} @ W + x_t) by keras.ops.scan over the time axis."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), name="w")

    def call(self, x):
        def step(h, xt):
            h = keras.ops.tanh(keras.ops.matmul(h, self.w) + xt)
            return h, h

        xs = keras.ops.transpose(x, (1, 0, 2))
        h, _ = keras.ops.scan(step, keras.ops.zeros_like(xs[0]), xs)
        return h


def test_keras_ops_scan_counts_each_step():
    profile, _ = _profile(lambda x: _Scan(name="scan")(x))
    scan = profile.layer("scan")
    assert scan.matmul_flops_fwd == T * 2 * B * I * I
    assert scan.matmul_flops_bwd == 2 * scan.matmul_flops_fwd
    # per step: matmul, the Add and the Tanh (B*I each), the index and counter increments;
    # the condition (i < n) runs T + 1 times
    assert scan.flops_fwd == T * (2 * B * I * I + 2 * B * I + 2) + (T + 1)
    assert scan.not_counted == ()


class _Fori(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), name="w")

    def call(self, x):
        return keras.ops.fori_loop(0, 5, lambda i, v: keras.ops.matmul(v, self.w), x)


def test_fori_loop_counts_its_static_trip_count():
    profile, _ = _profile(lambda x: _Fori(name="fori")(keras.layers.Flatten()(x)))
    fori = profile.layer("fori")
    assert fori.matmul_flops_fwd == 5 * 2 * B * (T * I) ** 2
    assert fori.matmul_flops_bwd == 2 * fori.matmul_flops_fwd


class _UntilSmall(keras.layers.Layer):
    """A loop whose condition reads data: its trip count is not static."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), name="w")

    def call(self, x):
        return tf.while_loop(lambda v: tf.reduce_sum(v) < 10.0,
                             lambda v: (tf.matmul(v, self.w),), (x,),
                             maximum_iterations=7)[0]


def test_a_data_dependent_loop_is_not_counted_and_the_profile_says_so():
    profile, _ = _profile(lambda x: _UntilSmall(name="until")(keras.layers.Flatten()(x)))
    until = profile.layer("until")
    assert until.flops_fwd == 0 and until.flops_bwd == 0
    loops = [n for n in until.not_counted if "(While)" in n or "(StatelessWhile)" in n]
    assert len(loops) == 2  # the loop and its gradient loop
    assert all("trip count unknown" in n for n in loops)
    assert "at most 7 (its maximum_iterations)" in loops[0]
    warnings = [w for w in profile.warnings if w.startswith("While loop")]
    assert len(warnings) == 2 and all("trip count unknown" in w and "layer until" in w
                                      for w in warnings)
    assert profile.not_counted  # and the profile lists them


# --- grouped convolutions: Keras runs them as an XLA-compiled tf.function (a call op) ----
def _convs(second):
    def make(x):
        h = keras.layers.Conv2D(16, 1, name="first")(x)
        return second(h)
    return _profile(make, (8, 8, 16))[0]


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_convolution_is_counted_exactly(groups):
    profile = _convs(keras.layers.Conv2D(32, 3, groups=groups, name="grouped"))
    conv = profile.layer("grouped")
    out = B * 6 * 6 * 32
    assert conv.matmul_flops_fwd == 2 * out * 3 * 3 * 16 // groups
    assert conv.flops_fwd == conv.matmul_flops_fwd + out  # + the bias
    # input and filter gradients, each the forward's multiply-adds
    assert conv.matmul_flops_bwd == 2 * conv.matmul_flops_fwd
    assert conv.not_counted == ()


def test_grouped_convolution_on_a_model_input_has_no_input_gradient():
    with tf.Graph().as_default():
        x = keras.Input((8, 8, 16))
        model = keras.Model(x, keras.layers.Conv2D(32, 3, groups=4, name="grouped")(x))
        conv = profile_and_trace(model, B, optimizer="sgd")[0].layer("grouped")
    assert conv.matmul_flops_bwd == conv.matmul_flops_fwd  # the filter gradient only


def test_grouped_convolution_with_groups_equal_channels_equals_a_depthwise_one():
    grouped = _convs(keras.layers.Conv2D(16, 3, groups=16, name="c")).layer("c")
    depthwise = _convs(keras.layers.DepthwiseConv2D(3, name="c")).layer("c")
    assert grouped.flops_fwd == depthwise.flops_fwd == 2 * B * 6 * 6 * 16 * 9 + B * 6 * 6 * 16
    assert grouped.flops_bwd == depthwise.flops_bwd
    assert grouped.groups == 16 and depthwise.groups == 1


# --- forward ops nothing depends on are pruned, model outputs are not ---------------------
class _ArgMax(keras.layers.Layer):
    def call(self, x):
        return keras.ops.argmax(x, axis=-1)


def test_an_integer_model_output_is_still_counted():
    with tf.Graph().as_default():
        x = keras.Input((I,))
        h = keras.layers.Dense(U, name="dense")(x)
        model = keras.Model(x, [h, _ArgMax(name="argmax")(h)])
        profile = profile_and_trace(model, B, optimizer="sgd")[0]
    # not part of the loss, but an output the step returns: Keras' argmax (its ArgMax,
    # prod(in) - prod(out), and the ops around it)
    assert profile.layer("argmax").flops_fwd >= B * U - B
