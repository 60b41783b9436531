"""Communication micro-benchmarks: point-to-point copies and TensorFlow's own all-reduce.

Pipeline position: run by ``profiler.hardware.profile_hardware`` over the
devices it profiles; results go into ``HardwareProfile.p2p`` and
``HardwareProfile.allreduce`` (``profiler.hw_profile``), each with an
alpha-beta fit (``fit_alpha_beta``). Timing follows ``profiler.hw_timing``.

All-reduce: ``tf.raw_ops.CollectiveReduceV2`` (merge Add, final Id), one op per
device inside one ``tf.function`` -- the collective that
``tf.distribute.MultiWorkerMirroredStrategy`` and TensorFlow's
``CollectiveAllReduce`` cross-device ops launch. Communication hint: ``nccl``
on GPUs, ``ring`` on CPUs (TensorFlow's RingReducer, which copies chunks
between the devices' buffers). Each op gets an ordering token (a resource
variable on its device), as ``CollectiveReplicaLauncher`` does: without one,
``tf.function``'s automatic control dependencies run the per-device ops one
after another and the first waits forever for its peers. Group keys are one
per device set; instance keys are never reused across ops (TensorFlow caches an
instance's shape and dtype by key). ``TIMEOUT_S`` turns a hang into an error.
The measured function chains 1 + k all-reduces (each reduces the previous
result), the reference chains 1.

Point-to-point: a float32 tensor hops src -> dst -> src -> ... through
pass-through ops placed alternately on the two devices, each hop reading the
one before; the measured function makes 1 + k hops, the reference 1, so the
time per hop is one copy in one direction, without the call's fixed cost. The
pass-through is ``tf.ensure_shape`` (EnsureShape forwards its input buffer), not
``tf.identity``: Grappler's dependency optimizer deletes chained Identity ops
even across devices (checked here: of a 5-hop Identity chain the partitioned
graph kept 1 hop; of a 5-hop EnsureShape chain, all 5). On GPUs a hop is
TensorFlow's device-to-device copy (DMA, over NVLink where there is one).
Logical CPU devices share host memory: TensorFlow hands the buffer over
without copying it, so a hop costs a few microseconds whatever its size, and
the fitted bandwidth is meaningless (enormous, or none).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from tfplan.core.errors import PlannerError
from tfplan.profiler.hw_profile import AllReduceResult, CommPoint, P2PResult, fit_alpha_beta
from tfplan.profiler.hw_timing import TimingPolicy, time_chain

TIMEOUT_S = 120.0
_GROUP_KEY_BASE = 0x4857_0000  # far above the keys tf.distribute's CollectiveKeys hands out
_group_keys: dict[tuple[str, ...], int] = {}
_instance_keys = itertools.count(_GROUP_KEY_BASE)


def hint_for(device_type: str) -> str:
    return "nccl" if device_type == "GPU" else "ring"


def _group_key(devices: tuple[str, ...]) -> int:
    if devices not in _group_keys:
        _group_keys[devices] = _GROUP_KEY_BASE + len(_group_keys) + 1
    return _group_keys[devices]


class _Collective:
    """Launches CollectiveReduceV2 sums over a fixed device set."""

    def __init__(self, devices: tuple[str, ...], hint: str):
        import tensorflow as tf

        self.devices, self.hint = devices, hint
        self.group_key = _group_key(devices)
        self.tokens = []
        for d in devices:
            with tf.init_scope(), tf.device(d):
                self.tokens.append(tf.Variable(0.0, trainable=False))

    def all_reduce(self, values: list) -> list:
        """One sum all-reduce; ``values[i]`` lives on ``devices[i]``. Call inside tf.function."""
        import tensorflow as tf

        instance_key = next(_instance_keys)  # one per all-reduce, shared by its devices
        out = []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                out.append(tf.raw_ops.CollectiveReduceV2(
                    input=values[i], group_size=len(self.devices), group_key=self.group_key,
                    instance_key=instance_key, ordering_token=[self.tokens[i].handle],
                    merge_op="Add", final_op="Id", communication_hint=self.hint,
                    timeout_seconds=TIMEOUT_S))
        return out


def allreduce_once(devices: Sequence[str], values: Sequence[np.ndarray],
                   hint: str) -> list[np.ndarray]:
    """Sum-all-reduce ``values[i]`` (placed on ``devices[i]``); every device's result."""
    import tensorflow as tf

    devs = tuple(devices)
    coll = _Collective(devs, hint)
    inputs = []
    for d, v in zip(devs, values):
        with tf.device(d):
            inputs.append(tf.constant(v))

    @tf.function
    def run():
        return coll.all_reduce(inputs)

    return [np.asarray(r) for r in _guard(run, devs)]


def allreduce_point(coll: _Collective, nbytes: int, policy: TimingPolicy) -> CommPoint:
    import tensorflow as tf

    elements = max(1, nbytes // 4)
    xs = []
    for d in coll.devices:
        with tf.device(d):
            xs.append(tf.Variable(tf.fill([elements], 1.0), trainable=False))

    def chain(k: int) -> Callable[[], object]:
        @tf.function
        def run():
            values = [x.read_value() for x in xs]
            for _ in range(k):
                values = coll.all_reduce(values)
            outs = []
            for d, v in zip(coll.devices, values):
                with tf.device(d):
                    outs.append(v[:1])
            return outs
        return run

    # Each all-reduce multiplies the values by n: keep n^(1+k) below float32's 3.4e38.
    max_k = int(37 / math.log10(len(coll.devices))) - 1
    _guard(chain(1), coll.devices)  # a hang surfaces here as an error, not inside the timing
    m = time_chain(chain, policy, max_k=max_k)
    return CommPoint(nbytes=elements * 4, seconds=m.seconds, method=m.method)


def allreduce_result(devices: Sequence[str], sizes_bytes: tuple[int, ...], hint: str,
                     policy: TimingPolicy,
                     tick: Callable[[], None] | None = None) -> AllReduceResult:
    devs = tuple(devices)
    _check_sum(devs, hint)
    coll = _Collective(devs, hint)
    points = []
    for nbytes in sizes_bytes:
        points.append(allreduce_point(coll, nbytes, policy))
        if tick is not None:
            tick()
    return AllReduceResult(devices=devs, implementation=f"CollectiveReduceV2/{hint}",
                           points=tuple(points), fit=fit_alpha_beta(points))


def p2p_point(src: str, dst: str, nbytes: int, policy: TimingPolicy) -> CommPoint:
    import tensorflow as tf

    elements = max(1, nbytes // 4)
    with tf.device(src):
        x = tf.Variable(tf.fill([elements], 1.0), trainable=False)

    def hops(k: int) -> Callable[[], object]:
        @tf.function
        def run():
            with tf.device(src):
                v = x.read_value()
            for i in range(k):  # src -> dst -> src ...: each hop waits for the one before
                with tf.device(dst if i % 2 == 0 else src):
                    v = tf.ensure_shape(v, [elements])
            with tf.device(dst if k % 2 else src):
                return v[-1:]
        return run

    m = time_chain(hops, policy)
    return CommPoint(nbytes=elements * 4, seconds=m.seconds, method=m.method)


def p2p_result(src: str, dst: str, sizes_bytes: tuple[int, ...], policy: TimingPolicy,
               tick: Callable[[], None] | None = None) -> P2PResult:
    points = []
    for nbytes in sizes_bytes:
        points.append(p2p_point(src, dst, nbytes, policy))
        if tick is not None:
            tick()
    return P2PResult(src=src, dst=dst, points=tuple(points), fit=fit_alpha_beta(points))


def _check_sum(devices: tuple[str, ...], hint: str) -> None:
    """Device i contributes [i+1, -(i+1)/2]; every device must end with the sums."""
    n = len(devices)
    values = [np.array([i + 1.0, -(i + 1.0) / 2], dtype=np.float32) for i in range(n)]
    want = np.sum(values, axis=0)
    got = allreduce_once(devices, values, hint)
    for d, g in zip(devices, got):
        if not np.allclose(g, want):
            raise PlannerError(
                f"TensorFlow's all-reduce ({hint}) over {list(devices)} returned {g.tolist()} on "
                f"{d}; expected the sum {want.tolist()}. The collective is broken on this "
                "installation: profile fewer devices (--devices) or check the TensorFlow/NCCL "
                "install.")


def _guard(fn: Callable[[], object], devices: tuple[str, ...]):
    import tensorflow as tf

    try:
        return fn()
    except tf.errors.DeadlineExceededError as e:
        raise PlannerError(
            f"TensorFlow's all-reduce over {list(devices)} did not finish within {TIMEOUT_S:g} s "
            f"(received: {e.message.splitlines()[0]}). Expected every device to join the "
            "collective; check that the devices are idle and profile fewer of them "
            "(--devices).") from None
