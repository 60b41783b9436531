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
* pipeline pp=2, m micro-batches: the wrapped model vs the hybrid's hand-written
  replica below with dp = 1: each layer built and called under ``tf.device`` of its
  stage's device, a ``tf.function`` step that loops over the micro-batches, takes
  ``tf.gradients`` (colocated with the forward ops), accumulates them and applies
  their mean once;
* tensor parallel tp=2: the search's plan with ``tp`` fixed at 2 (dp=1) vs a
  Megatron-style MLP written with ``tf.Variable`` + ``tf.device`` following the plan's
  ``tp_splits``: a column split keeps output columns ``[t*n/tp, (t+1)*n/tp)`` of the
  kernel and bias on rank t and computes (and activates) its output slice there; a row
  split keeps the matching input rows on rank t, multiplies the input slice there (a
  column layer's shards in place, nothing gathered) and sums the partial products with
  ``tf.add_n`` on rank 0, where the bias and activation follow; an unsplit layer, and
  the loss, run on rank 0, a column output concatenated there first. The weights are
  sliced from a ``build()`` model; the step is ``tf.gradients`` (colocated with the
  forward ops) and one Adam update whose slots and update math sit with each shard
  (``apply.placement``'s two helpers, as the wrapped model uses them);
* hybrid dp=2 x pp=2, m micro-batches (GPipe, no optimizer sharding): the wrapped
  model vs two hand-written pipeline replicas (replica r's stage s on
  ``stages[s].devices[r]``, each layer built and called under ``tf.device`` of it), each
  running half the batch in m micro-batches with ``tf.gradients``; each copy of a weight
  gets the replicas' accumulated gradients summed by ``tf.add_n`` on its own device, and
  one Adam updates every copy with that mean gradient, so the copies stay equal (as
  ``apply.tensor_parallel`` does).

For the last three, the first step's loss of both sides on the same batch must agree
within 1e-4 (relative), else the run stops with an error: both start from the same
weights and do the same work.

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
      [--only data]   (one strategy: single, data, pipeline, tensor or hybrid;
                 repeatable)
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
TP = 2
SAME_LOSS_REL = 1e-4  # first-step losses of the two sides, relative
STRATEGIES = ("single", "data", "pipeline", "tensor", "hybrid")


def _plans(profile, batch: int, microbatches: int, only=None):
    """``{strategy name: plan}`` for the strategies in ``only`` (first words; None: all),
    each from the search with the strategy's shape fixed."""
    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search

    cluster = parse_cluster(f"cpu:{DEVICES}")
    fixed = {
        "single device": lambda: search(profile, cluster, batch, fix={"dp": 1}).chosen,
        f"data parallel dp={DEVICES}": lambda: search(profile, cluster, batch,
                                                      fix={"dp": DEVICES}).chosen,
        f"pipeline pp=2 m={microbatches}": lambda: search(
            profile, cluster, batch, fix={"pp": 2, "num_microbatches": microbatches}).chosen,
        f"tensor parallel tp={TP}": lambda: _tensor_plan(profile, cluster, batch),
        f"hybrid dp=2 x pp=2 m={microbatches}": lambda: _hybrid_plan(
            profile, cluster, batch, microbatches),
    }
    return {name: plan() for name, plan in fixed.items()
            if not only or name.split()[0] in only}


def _hybrid_plan(profile, cluster, batch: int, microbatches: int):
    """dp=2 x pp=2 with GPipe and every replica's optimizer state (no ZeRO-1): the search
    picks 1F1B and optimizer sharding here unless told, and the hand-written side does
    neither."""
    from tfplan.planner.search import search

    fix = {"dp": 2, "pp": 2, "num_microbatches": microbatches, "schedule": "gpipe",
           "optimizer_sharding": False}
    return _checked(search(profile, cluster, batch, fix=fix).chosen, "hybrid", tp=1, **fix)


def _tensor_plan(profile, cluster, batch: int):
    """The search's plan with tp fixed at ``TP``; dp fixed at 1 too if it picked more."""
    from tfplan.planner.search import search

    plan = search(profile, cluster, batch, fix={"tp": TP}).chosen
    if plan.strategy.dp != 1:
        plan = search(profile, cluster, batch, fix={"tp": TP, "dp": 1}).chosen
    plan = _checked(plan, "tensor", tp=TP, dp=1, num_microbatches=1)
    if not plan.tp_splits:
        raise SystemExit(f"apply_overhead: plan {plan.name!r} (tp={TP}) splits no layer at "
                         f"global batch {batch}; a tensor-parallel comparison needs at least "
                         "one split. Use a larger --batch (the default splits all three).")
    return plan


def _checked(plan, strategy: str, **expected):
    """``plan`` when its strategy has the ``expected`` fields; else exit with what differs."""
    got = {k: getattr(plan.strategy, k) for k in expected}
    if got != expected:
        raise SystemExit(f"apply_overhead: the search's plan for --only {strategy} has "
                         f"{got}; expected {expected}. The comparison needs that plan.")
    return plan


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
    """One pipeline replica: ``_hand_hybrid`` with the plan's dp = 1."""
    return _hand_hybrid(build, optimizer, loss_name, plan)


def _shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[t*n/parts, (t+1)*n/parts)`` for each t (the first slices one larger when
    ``parts`` does not divide ``n``, as ``apply.sharded_layers.shard_sizes``)."""
    sizes = [n // parts + (1 if t < n % parts else 0) for t in range(parts)]
    ends = [sum(sizes[:t]) for t in range(parts + 1)]
    return list(zip(ends[:-1], ends[1:]))


class _HandShardedDense:
    """One Dense layer of the hand-written tensor-parallel MLP: its kernel and bias
    sliced from ``layer`` into ``tf.Variable`` s on their ranks (Megatron-LM, Shoeybi et
    al. 2019, Sec. 3): ``split`` "column" (output columns), "row" (input rows, the bias
    whole on rank 0) or "" (unsplit, on rank 0)."""

    def __init__(self, layer, split: str, devices) -> None:
        import keras
        import tensorflow as tf

        if not isinstance(layer, keras.layers.Dense) or not layer.use_bias:
            raise SystemExit(f"apply_overhead: layer {layer.name!r} is not a Dense layer "
                             "with a bias; the hand-written tensor-parallel MLP has no "
                             "other kind.")
        kernel, bias = layer.get_weights()
        self.split, self.activation = split, layer.activation
        self.devices = tuple(devices) if split else tuple(devices[:1])
        axis = 1 if split == "column" else 0
        bounds = _shard_bounds(kernel.shape[axis], len(self.devices))
        self.sizes = [hi - lo for lo, hi in bounds]
        kernels = [kernel[:, lo:hi] if axis else kernel[lo:hi] for lo, hi in bounds]
        biases = [bias[lo:hi] for lo, hi in bounds] if split == "column" else [bias]
        self.kernels, self.biases = [], []
        for t, d in enumerate(self.devices):
            with tf.device(d):
                self.kernels.append(tf.Variable(kernels[t], name=f"{layer.name}_kernel_{t}"))
                if t < len(biases):
                    self.biases.append(tf.Variable(biases[t], name=f"{layer.name}_bias_{t}"))

    @property
    def variables(self) -> list:
        return self.kernels + self.biases

    def __call__(self, x, shards):
        """(whole input on rank 0 or None, column shards of it or None) -> the same of the
        output."""
        import tensorflow as tf

        if self.split == "row":
            return self._row(x, shards), None
        x = _gathered(x, shards, self.devices[0])
        outs = []
        for kernel, bias, d in zip(self.kernels, self.biases, self.devices):
            with tf.device(d):
                outs.append(self.activation(tf.matmul(x, kernel) + bias))
        return (None, outs) if self.split == "column" else (outs[0], None)

    def _row(self, x, shards):
        import tensorflow as tf

        if shards is None or [s.shape[-1] for s in shards] != self.sizes:
            x = _gathered(x, shards, self.devices[0])
            shards = []
            for (lo, hi), d in zip(_shard_bounds(x.shape[-1], len(self.devices)),
                                   self.devices):
                with tf.device(d):
                    shards.append(x[:, lo:hi])
        partial = []
        for part, kernel, d in zip(shards, self.kernels, self.devices):
            with tf.device(d):
                partial.append(tf.matmul(part, kernel))
        with tf.device(self.devices[0]):
            return self.activation(tf.add_n(partial) + self.biases[0])


def _gathered(x, shards, device: str):
    """The whole tensor: ``x``, or the column shards concatenated on ``device``."""
    import tensorflow as tf

    if shards is None:
        return x
    with tf.device(device):
        return tf.concat(shards, axis=-1)


def _hand_tensor_parallel(build, optimizer, loss_name, plan):
    import keras
    import tensorflow as tf
    from tfplan.apply.placement import build_optimizer_on_devices, updates_on_variable_devices

    tp, splits = plan.strategy.tp, dict(plan.tp_splits)
    devices = {name: stage.devices[:tp] for stage in plan.stages for name in stage.layers}
    source = build()  # the architecture and initial weights, sliced by hand below
    layers = [_HandShardedDense(layer, splits.get(layer.name, ""), devices[layer.name])
              for layer in source.layers[1:]]
    variables = [v for layer in layers for v in layer.variables]
    opt = optimizer()
    build_optimizer_on_devices(opt, variables)  # each slot on its shard's device
    loss_fn = keras.losses.get(loss_name)

    @tf.function
    def step(xb, yb):
        x, shards = xb, None
        for layer in layers:
            x, shards = layer(x, shards)
        with tf.device(layers[-1].devices[0]):
            loss = tf.reduce_mean(loss_fn(yb, _gathered(x, shards, layers[-1].devices[0])))
        grads = tf.gradients(loss, variables)  # colocated with the forward ops
        with updates_on_variable_devices(opt):  # each update on its shard's device
            opt.apply(grads, variables)
        return loss
    return step


def _hand_replica_layers(source, plan, r: int) -> list:
    """``(layer, device)`` for each layer of ``source`` (a chain), re-created and built
    under ``tf.device`` of replica r's device of its stage, with ``source`` 's weights."""
    import tensorflow as tf

    device_of = {name: stage.devices[r] for stage in plan.stages for name in stage.layers}
    out = []
    for layer in source.layers[1:]:
        device = device_of[layer.name]
        with tf.device(device):
            clone = layer.__class__.from_config(layer.get_config())
            clone.build(layer.input.shape)
            clone.set_weights(layer.get_weights())
        out.append((clone, device))
    return out


def _hand_hybrid(build, optimizer, loss_name, plan):
    import keras
    import tensorflow as tf
    from tfplan.apply.placement import build_optimizer_on_devices, updates_on_variable_devices

    dp, m = plan.strategy.dp, plan.strategy.num_microbatches
    source = build()
    replicas = [_hand_replica_layers(source, plan, r) for r in range(dp)]
    variables = [[v for layer, _ in rep for v in layer.trainable_variables]
                 for rep in replicas]
    every_copy = [v for vs in variables for v in vs]
    opt = optimizer()  # one Adam over every copy, slots with each copy
    build_optimizer_on_devices(opt, every_copy)
    loss_fn = keras.losses.get(loss_name)

    def replica_loss(rep, x, y):
        for layer, device in rep:
            with tf.device(device):
                x = layer(x, training=True)
        with tf.device(rep[-1][1]):  # the replica's share of the mean loss
            return tf.reduce_mean(loss_fn(y, x)) / dp

    @tf.function
    def step(xb, yb):
        totals, losses = [], []
        for rep, vs, xr, yr in zip(replicas, variables, tf.split(xb, dp), tf.split(yb, dp)):
            total = None
            for xi, yi in zip(tf.split(xr, m), tf.split(yr, m)):
                loss = replica_loss(rep, xi, yi)
                grads = tf.gradients(loss, vs)  # colocated with the forward ops
                total = grads if total is None else [
                    _on_device_of(v, lambda a=a, g=g: a + g) for a, g, v in zip(total, grads, vs)]
                losses.append(loss)
            totals.append(total)
        mean = [_on_device_of(v, lambda i=i: tf.add_n([t[i] for t in totals]) / m)
                for vs in variables for i, v in enumerate(vs)]
        with updates_on_variable_devices(opt):  # each copy's update on its device
            opt.apply(mean, every_copy)
        return tf.add_n(losses) / m
    return step


def _on_device_of(variable, fn):
    """``fn()`` under ``tf.device`` of the (keras) variable's device."""
    import tensorflow as tf

    with tf.device(variable.value.device):
        return fn()


def _hand_written(name: str, plan, build, optimizer, loss, devices):
    """The hand-written step of strategy ``name`` (its first word picks it)."""
    kind = name.split()[0]
    if kind == "single":
        return _hand_single(build, optimizer, loss)
    if kind == "data":
        return _hand_data_parallel(build, optimizer, loss, devices)
    if kind == "pipeline":
        return _hand_pipeline(build, optimizer, loss, plan)
    if kind == "tensor":
        return _hand_tensor_parallel(build, optimizer, loss, plan)
    return _hand_hybrid(build, optimizer, loss, plan)


def _same_first_loss(name: str, hand, wrapped, x, y) -> None:
    """Run the first step of both sides on the same batch; exit with an error unless their
    losses agree within ``SAME_LOSS_REL`` (same weights, same work)."""
    h, w = _loss_value(hand(x, y)), _loss_value(wrapped(x, y))
    if not abs(w - h) <= SAME_LOSS_REL * abs(w):
        raise SystemExit(f"apply_overhead: {name}: the first step's loss is {h!r} "
                         f"hand-written and {w!r} wrapped (relative difference "
                         f"{abs(w - h) / abs(w):.2e}, expected <= {SAME_LOSS_REL}); the two "
                         "sides do not compute the same step.")


def _loss_value(result) -> float:
    return float(result.numpy() if hasattr(result, "numpy") else result)


def _wrapped(build, optimizer, loss, plan):
    from tfplan import apply
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
        _loss_value(result)
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
    ap.add_argument("--only", action="append", choices=STRATEGIES,
                    help="time only this strategy (repeatable; default: all)")
    args = ap.parse_args(argv)

    from tfplan.profiler.tf_runtime import import_tensorflow
    tf = import_tensorflow()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(DEVICES)])
    import keras
    import numpy as np

    from tfplan.profiler.loader import build as build_source, load_model_source
    from tfplan.profiler.static import profile_source

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
    for name, plan in _plans(profile, args.batch, args.microbatches, args.only).items():
        hand = _hand_written(name, plan, build, optimizer, loss, devices)
        wrapped = _wrapped(build, optimizer, loss, plan)
        if name.split()[0] in ("pipeline", "tensor", "hybrid"):
            _same_first_loss(name, hand, wrapped, x, y)
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
