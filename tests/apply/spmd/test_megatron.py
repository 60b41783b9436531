"""apply.spmd.megatron: each rank's side of Megatron's f, g, gather and scatter, forward and
backward, on two logical CPUs (every rank traced in one tf.function, as the engine does)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfplan.apply.groups import Group, group_key
from tfplan.apply.spmd.megatron import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

DEVICES = ("/device:CPU:0", "/device:CPU:1")
GROUP = Group("tp", DEVICES, group_key(DEVICES))


def _run(op, xs, upstream):
    """Each rank's forward of ``op`` on xs[r] and the gradient of sum(y_r * upstream[r])
    with respect to xs[r], computed on rank r alone."""
    @tf.function
    def step():
        outs, grads = [], []
        for d, x, u in zip(DEVICES, xs, upstream):
            with tf.device(d):
                v = tf.constant(x)
                with tf.GradientTape() as tape:
                    tape.watch(v)
                    y = op(v, GROUP, d)
                    loss = tf.reduce_sum(y * u)
                outs.append(y)
                grads.append(tape.gradient(loss, v))
        return outs, grads
    outs, grads = step()
    return [o.numpy() for o in outs], [g.numpy() for g in grads]


X = [np.arange(4, dtype="float32").reshape(1, 4), np.ones((1, 4), "float32")]
U = [np.full((1, 4), 2.0, "float32"), np.full((1, 4), 3.0, "float32")]


def test_f_is_identity_forward_and_sums_the_gradients_backward():
    outs, grads = _run(copy_to_tp, X, U)
    np.testing.assert_array_equal(outs[0], X[0])
    np.testing.assert_array_equal(grads[0], grads[1])
    np.testing.assert_array_equal(grads[0], U[0] + U[1])


def test_g_sums_forward_and_is_identity_backward():
    outs, grads = _run(reduce_from_tp, X, U)
    np.testing.assert_array_equal(outs[0], X[0] + X[1])
    np.testing.assert_array_equal(outs[1], X[0] + X[1])
    np.testing.assert_array_equal(grads[1], U[1])


def test_gather_joins_the_last_axis_and_keeps_the_own_gradient_slice():
    upstream = [np.arange(8, dtype="float32").reshape(1, 8)] * 2
    outs, grads = _run(gather_from_tp, X, upstream)
    np.testing.assert_array_equal(outs[0], np.concatenate(X, axis=-1))
    np.testing.assert_array_equal(grads[1], upstream[1][:, 4:])


def test_scatter_keeps_the_own_slice_and_gathers_the_gradient():
    outs, grads = _run(scatter_to_tp, X, [np.full((1, 2), 5.0, "float32"),
                                          np.full((1, 2), 7.0, "float32")])
    np.testing.assert_array_equal(outs[1], X[1][:, 2:])
    np.testing.assert_array_equal(grads[0], [[5.0, 5.0, 7.0, 7.0]])
