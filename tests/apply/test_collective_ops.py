"""The collectives of ``apply.collective_ops`` leave no thread behind.

TensorFlow 2.21 serves a collective's ``timeout_seconds`` with a thread that sleeps the
whole timeout, so a timeout on every collective left a thread per collective alive: the
suite's workers (and a long training run) ran out of threads and aborted. 200 traced
steps of a two-member all-reduce must leave the process's thread count where it was
(give or take TensorFlow's pools warming up).
"""
from __future__ import annotations

import os

from tests.apply.helpers import cpus


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_collectives_leave_no_thread_behind():
    import numpy as np
    import tensorflow as tf

    from tfplan.apply.collective_ops import instance_scope, member_all_reduce
    from tfplan.apply.groups import Group, group_key

    devices = tuple(cpus(6, 7))
    group = Group("dp", devices, group_key(devices))

    @tf.function
    def step(x):
        with instance_scope():
            out = []
            for device in devices:
                with tf.device(device):
                    out.append(member_all_reduce(x, group, device))
            return out

    x = tf.ones([4])
    np.testing.assert_allclose(step(x)[0].numpy(), 2.0)  # traced, the pools started
    before = _threads()
    for _ in range(200):
        step(x)
    assert _threads() - before < 20, (before, _threads())
