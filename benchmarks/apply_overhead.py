"""Benchmark: a model wrapped by ``apply.wrap`` against the same strategy written by hand.

Pipeline position: outside the pipeline; it checks issue 5's performance target --
the wrapped model's step time is within 5% of equivalent hand-written tf.distribute /
tf.device code for the same strategy -- as a ratio measured in one run.

For examples/mlp.py (global batch ``--batch``, Adam, 4 logical CPU devices):

* single device: ``apply.wrap`` with a one-device plan vs a plain Keras model, both
  through ``train_on_batch``;
* data parallel dp=4: the wrapped model vs a hand-written ``MirroredStrategy`` step
  (model and optimizer made in ``strategy.scope()``, the batch split into one slice per
  replica with ``experimental_distribute_values_from_function``, ``strategy.run`` of a
  ``tf.function`` step, gradients summed by the optimizer's all-reduce);
* pipeline pp=2, m micro-batches: the wrapped model vs a hand-written one: the layers
  built under ``tf.device`` of their stage's device, a ``tf.function`` step that loops
  over the micro-batches, takes ``tf.gradients`` (colocated with the forward ops),
  accumulates them and applies their mean once.

The two of each pair are timed in alternating rounds (``--rounds`` x ``--steps``
steps after ``--warmup``), so drift on this shared machine hits both alike; the
figure is median(wrapped) / median(hand-written) of the wall time per step (the
target), with the same ratio of this process's CPU time per step beside it (other
processes on a shared machine disturb it less). Both sides of a pair do the same
work per step: the forward and backward pass, one optimizer update, and the step's
loss read back to the host (the wrapped model keeps it in Keras' loss tracker, the
hand-written step reduces it across replicas); in data parallel both hand over the
batch as numpy slices that become tensors when the step is called.

Run:  .venv/bin/python benchmarks/apply_overhead.py [--batch 16384] [--rounds 5] [--json]
      [--only data]   (one strategy: single, data or pipeline; repeatable)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEVICES = 4
TARGET = 1.05  # wrapped / hand-written


def _plans(profile, batch: int, microbatches: int):
    from planner.presets import parse_cluster
    from planner.search import search

    cluster = parse_cluster(f"cpu:{DEVICES}")
    return {
        "single device": search(profile, cluster, batch, fix={"dp": 1}).chosen,
        f"data parallel dp={DEVICES}": search(profile, cluster, batch,
                                              fix={"dp": DEVICES}).chosen,
        f"pipeline pp=2 m={microbatches}": search(
            profile, cluster, batch, fix={"pp": 2, "num_microbatches": microbatches}).chosen,
    }


def _hand_single(build, optimizer, loss):
    model = build()
    model.compile(optimizer=optimizer(), loss=loss)
    return lambda x, y: model.train_on_batch(x, y)


def _hand_data_parallel(build, optimizer, loss_name, devices):
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = build()
        opt = optimizer()
        loss_fn = keras.losses.get(loss_name)
        opt.build(model.trainable_variables)
    n = strategy.num_replicas_in_sync

    @tf.function
    def step(x, y):
        def replica(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(yr, model(xr, training=True))) / n
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss
        per_replica = strategy.run(replica, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def run(x, y):
        size = x.shape[0] // n
        xs = strategy.experimental_distribute_values_from_function(
            lambda ctx: x[ctx.replica_id_in_sync_group * size:
                          (ctx.replica_id_in_sync_group + 1) * size])
        ys = strategy.experimental_distribute_values_from_function(
            lambda ctx: y[ctx.replica_id_in_sync_group * size:
                          (ctx.replica_id_in_sync_group + 1) * size])
        return step(xs, ys)
    return run


def _hand_pipeline(build, optimizer, loss_name, plan):
    import keras
    import tensorflow as tf

    device_of = plan.device_of_layer()
    source = build()  # the architecture; rebuilt layer by layer under tf.device
    inputs = keras.Input(shape=source.input_shape[1:], name="features")
    x = inputs
    for layer in source.layers[1:]:
        with tf.device(device_of[layer.name]):
            clone = layer.__class__.from_config(layer.get_config())
            x = clone(x)
    model = keras.Model(inputs, x)
    opt = optimizer()
    loss_fn = keras.losses.get(loss_name)
    with tf.device(plan.stages[0].devices[0]):
        opt.build(model.trainable_variables)
    m = plan.strategy.num_microbatches
    variables = model.trainable_variables

    @tf.function
    def step(xb, yb):
        total = [tf.zeros_like(v) for v in variables]
        losses = []
        for xi, yi in zip(tf.split(xb, m), tf.split(yb, m)):
            loss = tf.reduce_mean(loss_fn(yi, model(xi, training=True)))
            grads = tf.gradients(loss, variables)  # colocated with the forward ops
            total = [a + g for a, g in zip(total, grads)]
            losses.append(loss)
        opt.apply([g / m for g in total], variables)
        return tf.add_n(losses) / m
    return step


def _wrapped(build, optimizer, loss, plan):
    import apply

    model = apply.wrap(build(), plan)
    model.compile(optimizer=optimizer(), loss=loss)
    return lambda x, y: model.train_on_batch(x, y)


def _timed(fn, x, y, steps: int, cpu_s_per_step: list[float] | None = None) -> list[float]:
    """Seconds per step; each step's loss is read back to the host (as train_on_batch
    does), so asynchronous dispatch cannot hide a step's time. ``cpu_s_per_step`` gets
    this process's CPU seconds per step over the ``steps`` (all threads): the work done,
    which other processes on a shared machine disturb less than the wall time."""
    out = []
    cpu_start_s = time.process_time()
    for _ in range(steps):
        t = time.perf_counter()
        result = fn(x, y)
        float(result.numpy() if hasattr(result, "numpy") else result)
        out.append(time.perf_counter() - t)
    if cpu_s_per_step is not None:
        cpu_s_per_step.append((time.process_time() - cpu_start_s) / steps)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", action="append", choices=("single", "data", "pipeline"),
                    help="time only this strategy (repeatable; default: all three)")
    args = ap.parse_args(argv)

    from profiler.tf_runtime import import_tensorflow
    tf = import_tensorflow()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(DEVICES)])
    import keras
    import numpy as np

    from profiler.loader import build as build_source, load_model_source
    from profiler.static import profile_source

    source = load_model_source(os.path.join(ROOT, "examples", "mlp.py"))
    profile = profile_source(source, batch_size=1)

    def build():
        keras.utils.set_random_seed(0)
        return build_source(source)

    optimizer = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    loss = source.loss
    x, y = source.sample_batch(args.batch)
    x, y = np.asarray(x), np.asarray(y)
    devices = [f"/device:CPU:{i}" for i in range(DEVICES)]
    rows = []
    for name, plan in _plans(profile, args.batch, args.microbatches).items():
        if args.only and name.split()[0] not in args.only:
            continue
        if name.startswith("single"):
            hand = _hand_single(build, optimizer, loss)
        elif name.startswith("data"):
            hand = _hand_data_parallel(build, optimizer, loss, devices)
        else:
            hand = _hand_pipeline(build, optimizer, loss, plan)
        wrapped = _wrapped(build, optimizer, loss, plan)
        _timed(hand, x, y, args.warmup)
        _timed(wrapped, x, y, args.warmup)
        t_hand, t_wrapped, cpu_hand, cpu_wrapped = [], [], [], []
        for _ in range(args.rounds):
            t_hand += _timed(hand, x, y, args.steps, cpu_hand)
            t_wrapped += _timed(wrapped, x, y, args.steps, cpu_wrapped)
        h, w = statistics.median(t_hand), statistics.median(t_wrapped)
        cpu_ratio = statistics.median(cpu_wrapped) / statistics.median(cpu_hand)
        rows.append({"strategy": name, "hand_written_s": h, "wrapped_s": w, "ratio": w / h,
                     "cpu_time_ratio": cpu_ratio, "within_5_percent": w / h <= TARGET})
        if not args.json:
            print(f"{name:<24} hand-written {h * 1e3:8.2f} ms   wrapped {w * 1e3:8.2f} ms   "
                  f"ratio {w / h:5.3f}  {'ok' if w / h <= TARGET else 'OVER 5%'}   "
                  f"(CPU time ratio {cpu_ratio:5.3f})", flush=True)
    summary = f"{sum(r['within_5_percent'] for r in rows)} of {len(rows)} within 5%"
    if args.json:
        print(json.dumps({"batch": args.batch, "rows": rows, "summary": summary}, indent=1))
    else:
        print(summary + f" (examples/mlp.py, global batch {args.batch}, "
              f"{args.rounds}x{args.steps} steps per side, load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
