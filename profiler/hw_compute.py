"""Compute micro-benchmarks on one device: achieved matmul FLOP/s and memory bandwidth.

Pipeline position: run by ``profiler.hardware.profile_hardware`` on the first
of the devices it profiles; the results go into ``HardwareProfile.matmul`` and
``HardwareProfile.memory_bandwidth`` (``profiler.hw_profile``). Timing follows
``profiler.hw_timing``: paired differences of 1 + k against 1 operations.

Matmul: C_{i+1} = C_i @ B on n x n matrices in the precision measured, chained
so that each waits for the one before (the entries of A and B are drawn with
standard deviation 1/sqrt(n), so the chain's values stay O(1) in float16).
A matmul is n^3 multiply-adds = 2 n^3 FLOPs. On GPUs TensorFlow runs float32
matmuls in TF32 where the GPU has it, unless
``tf.config.experimental.enable_tensor_float_32_execution(False)``; the float32
figure is what TensorFlow actually runs, the same convention
``DeviceSpec.peak_flops`` prices float32 models with.

Memory bandwidth: ``a.assign_add(b)`` on two float32 variables of
``buffer_bytes`` each, in place (no allocation, so no page faults are timed):
3 x buffer_bytes moved per pass (see ``MemoryBandwidth``). The buffers should
be several times the last-level cache.

Layer overhead: one Keras ``Dense(width, relu)`` layer called 1 + k times in
a chain (each call's output is the next one's input) against once, forward and
backward under a ``GradientTape``, inside one ``tf.function``; the time per
extra call minus the time its FLOPs take at the measured matmul rate is the
fixed cost of a layer (see ``LayerOverhead``). The same layer object is reused,
so the function returns two gradients (the tape sums the calls' gradients with
one AddN per variable) whatever k is. The layer is tiny (8 x 32 by default)
so that the fixed cost, not the arithmetic, dominates.
"""
from __future__ import annotations

from typing import Callable

from tfplan.core.errors import PlannerError
from tfplan.profiler.hw_profile import LayerOverhead, MatmulPoint, MatmulResult, MemoryBandwidth
from tfplan.profiler.hw_timing import TimingPolicy, time_chain

MEASURABLE_PRECISIONS = ("float32", "float16", "bfloat16")


def check_precisions(precisions: tuple[str, ...]) -> None:
    bad = [p for p in precisions if p not in MEASURABLE_PRECISIONS]
    if bad or not precisions:
        raise PlannerError(
            f"Cannot measure matmuls in precision(s) {bad or list(precisions)}; expected one or "
            f"more of {list(MEASURABLE_PRECISIONS)}. (tf32 is how TensorFlow runs float32 on "
            "GPUs that have it: measure float32.)")


def matmul_point(device: str, precision: str, n: int, policy: TimingPolicy) -> MatmulPoint:
    """Time one n x n matmul in ``precision`` on ``device``."""
    import tensorflow as tf

    dtype = tf.as_dtype(precision)
    with tf.device(device):
        a = tf.Variable(tf.cast(tf.random.normal([n, n], stddev=n ** -0.5, seed=1), dtype),
                        trainable=False)
        b = tf.Variable(tf.cast(tf.random.normal([n, n], stddev=n ** -0.5, seed=2), dtype),
                        trainable=False)

    def chain(k: int) -> Callable[[], object]:
        @tf.function
        def run():
            with tf.device(device):
                c = a.read_value()
                for _ in range(k):
                    c = tf.matmul(c, b)
                return c[:1, :1]
        return run

    m = time_chain(chain, policy)
    return MatmulPoint(n=n, seconds=m.seconds, method=m.method)


def matmul_result(device: str, precision: str, sizes: tuple[int, ...], policy: TimingPolicy,
                  tick: Callable[[], None] | None = None) -> MatmulResult:
    points = []
    for n in sizes:
        points.append(matmul_point(device, precision, n, policy))
        if tick is not None:
            tick()
    return MatmulResult(precision=precision, points=tuple(points))


def memory_bandwidth(device: str, buffer_bytes: int, policy: TimingPolicy) -> MemoryBandwidth:
    """Time one in-place ``a += b`` pass over two float32 buffers of ``buffer_bytes``."""
    import tensorflow as tf

    elements = max(1, buffer_bytes // 4)
    with tf.device(device):
        a = tf.Variable(tf.zeros([elements], tf.float32), trainable=False)
        b = tf.Variable(tf.fill([elements], 1e-3), trainable=False)

    def passes(k: int) -> Callable[[], object]:
        @tf.function
        def run():
            with tf.device(device):
                for _ in range(k):
                    a.assign_add(b)  # resource ops on one variable run in program order
                return a[:1]
        return run

    m = time_chain(passes, policy)
    return MemoryBandwidth(buffer_bytes=elements * 4, seconds=m.seconds, method=m.method)


def layer_overhead(device: str, flops_per_s: float, policy: TimingPolicy, batch: int = 8,
                   width: int = 32) -> LayerOverhead:
    """Time one more tiny Dense layer's forward + backward on ``device`` (module docstring).

    ``flops_per_s`` prices the layer's FLOPs (the best float32 matmul rate
    measured); the overhead is what the measured time leaves beyond them.
    """
    import keras
    import tensorflow as tf

    with tf.device(device):
        layer = keras.layers.Dense(width, activation="relu", dtype="float32")
        layer.build((batch, width))
        x = tf.Variable(tf.random.normal([batch, width], stddev=width ** -0.5, seed=3),
                        trainable=False)
    variables = [layer.kernel, layer.bias]

    def chain(k: int) -> Callable[[], object]:
        @tf.function
        def run():
            with tf.device(device):
                with tf.GradientTape() as tape:
                    y = x.read_value()
                    for _ in range(k):
                        y = layer(y)
                    loss = tf.reduce_sum(y)
                grads = tape.gradient(loss, variables)
                return [g[:1] for g in grads]
        return run

    m = time_chain(chain, policy)
    return LayerOverhead(batch=batch, width=width, seconds=m.seconds, flops_per_s=flops_per_s,
                         method=m.method)
