"""Batch normalisation under a plan: how its statistics are computed, in every mode.

Pipeline position: ``apply.wrap`` calls ``install`` on every copy of the model it builds
(``plan.strategy.batch_norm``); ``apply.planned_model``'s train step opens a
``StepStats`` around each step (``stepping``), and ``apply.joint_forward`` hands
``global`` statistics to it. Nothing here decides a plan: ``planner.batch_stats``
prices the choice and says what it costs.

One device normalises a BatchNormalization layer's input with the mean and variance of
the whole batch, and moves its moving statistics once per step. A plan cuts the batch
into parts (``dp`` replicas x ``num_microbatches`` micro-batches); Keras, left alone,
normalises each part with its own statistics and lets each replica keep its own moving
statistics (they drift apart, and ``get_weights`` returns replica 0's while ``predict``
uses each replica's). Here a plan says which of two rules holds (``MODES``):

* ``global``: every part is normalised with the statistics of the whole step's batch
  (every replica and micro-batch), exactly as one device does. The sums of ``x`` and of
  ``(x - mean)^2`` over each part are added across the parts (and all-reduced across the
  replicas of a ``tf.distribute`` strategy: MirroredStrategy, MultiWorkerMirrored), so
  each layer needs every part's input before any part continues: a barrier per layer.
  ``apply.joint_forward`` runs the step's parts layer by layer for this.
* ``local``: each part is normalised with its own statistics (GPipe's rule, Huang et
  al., 2019, and Keras' under MirroredStrategy); losses differ from one device's.

Either way the moving statistics are updated once per step, with the mean over the
step's parts of their statistics (``global``: the whole batch's), to the same value on
every replica and every copy of the layer: ``moving = moving * momentum + batch * (1 -
momentum)`` with the biased variance, Keras' rule. So ``save_weights``, ``predict`` and
``evaluate`` all see one value. Not applied: batch renormalisation (``renorm=True``),
BatchNormalization layers inside nested models, and masked inputs (PlannerError naming
the layer). Outside a planned train step (``model(x, training=True)`` by hand) a layer
behaves as Keras' own.
"""
from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Any, Iterator, Sequence

import keras
import tensorflow as tf

from tfplan.apply.placement import on_variable_device
from tfplan.core.errors import PlannerError

GLOBAL, LOCAL = "global", "local"
MODES = (GLOBAL, LOCAL)

_STEP: contextvars.ContextVar["StepStats | None"] = contextvars.ContextVar(
    "tfplan_batch_stats_step", default=None)


def batch_norm_layers(model: Any) -> list[Any]:
    """The model's top-level BatchNormalization layers, in layer order."""
    return [layer for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)]


def _nested_batch_norm(model: Any) -> list[str]:
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found += [f"{layer.name}/{l.name}" for l in batch_norm_layers(layer)]
            found += [f"{layer.name}/{n}" for n in _nested_batch_norm(layer)]
    return found


def install(model: Any, mode: str) -> int:
    """Make ``model``'s BatchNormalization layers follow ``mode`` inside planned train steps;
    returns how many there are. PlannerError for what is not applied (module docstring)."""
    if mode not in MODES:
        raise PlannerError(f"Plan's batch_norm is {mode!r}; expected one of {MODES}.")
    nested = _nested_batch_norm(model)
    if nested:
        raise PlannerError(
            f"Model {model.name!r} has BatchNormalization layer {nested[0]!r} inside a nested "
            "model; apply computes batch statistics for top-level layers only. Flatten the "
            "model (build it from the nested model's layers) so its batch statistics follow "
            "the plan.")
    layers = batch_norm_layers(model)
    for layer in layers:
        if layer.renorm:
            raise PlannerError(
                f"BatchNormalization layer {layer.name!r} uses batch renormalisation "
                "(renorm=True), which apply cannot split across replicas or micro-batches. "
                "Train it without renorm, or on one device with one micro-batch.")
        # an instance attribute: Keras' Layer.__call__ calls self.call
        object.__setattr__(layer, "call", types.MethodType(_planned_call, layer))
    return len(layers)


def _planned_call(layer: Any, inputs: Any, training: Any = None, mask: Any = None) -> Any:
    step = _STEP.get()
    if step is None or not training or not layer.trainable:
        return type(layer).call(layer, inputs, training=training, mask=mask)
    if mask is not None:
        raise PlannerError(
            f"BatchNormalization layer {layer.name!r} received a mask; apply cannot combine "
            "masked batch statistics across replicas or micro-batches. Train that model on "
            "one device with one micro-batch.")
    return step.normalize(layer, inputs)


def reduction_axes(layer: Any, rank: int) -> list[int]:
    """The axes a BatchNormalization layer reduces over: all but its feature axis."""
    axis = layer.axis % rank
    return [i for i in range(rank) if i != axis]


def as_float(x: Any) -> Any:
    """``x`` in the dtype Keras' BatchNormalization computes in (float32 or wider)."""
    return tf.cast(x, keras.backend.result_type(x.dtype, "float32"))


class StepStats:
    """One train step's batch statistics: the moments handed to each layer (``global``)
    or recorded from each part (``local``), and the one moving-statistics update."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._given: dict[int, tuple[Any, Any]] = {}
        self._records: dict[str, list[tuple[Any, Any, Any]]] = {}

    def give(self, layer: Any, mean: Any, variance: Any) -> None:
        """The whole step's moments for ``layer`` (one copy of it), from
        ``apply.joint_forward``; the moving statistics are updated with them."""
        self._given[id(layer)] = (mean, variance)
        self._records.setdefault(layer.name, []).append((layer, mean, variance))

    def normalize(self, layer: Any, inputs: Any) -> Any:
        x = as_float(inputs)
        given = self._given.get(id(layer))
        if given is None:
            if self.mode == GLOBAL:
                raise PlannerError(
                    f"BatchNormalization layer {layer.name!r} ran outside apply's layer-by-"
                    "layer step, so its global batch statistics are unknown (a layer called "
                    "from another layer's call?). Use a plan with batch_norm 'local' "
                    "(plan analyze --batch-norm local).")
            mean, variance = tf.nn.moments(x, reduction_axes(layer, len(x.shape)))
            self._records.setdefault(layer.name, []).append((layer, mean, variance))
        else:
            mean, variance = given
        return normalized(layer, x, mean, variance)

    def update_moving(self) -> None:
        """Move every layer's statistics once: the mean of the step's records of it, the
        same value on every replica (all-reduced in a replica context) and every copy."""
        ctx = tf.distribute.get_replica_context()
        sync = ctx is not None and ctx.num_replicas_in_sync > 1 and self.mode == LOCAL
        for name, records in self._records.items():
            layers = list({id(l): l for l, _, _ in records}.values())
            with on_variable_device(layers[0].moving_mean):
                if self.mode == GLOBAL:  # every copy was given the same moments
                    mean, variance = records[0][1], records[0][2]
                else:
                    n = float(len(records))
                    mean = tf.add_n([tf.stop_gradient(m) for _, m, _ in records]) / n
                    variance = tf.add_n([tf.stop_gradient(v) for _, _, v in records]) / n
                if sync:
                    mean, variance = ctx.all_reduce(tf.distribute.ReduceOp.MEAN,
                                                    [mean, variance])
                mean, variance = tf.stop_gradient(mean), tf.stop_gradient(variance)
            for layer in layers:
                with on_variable_device(layer.moving_mean):
                    for var, value in ((layer.moving_mean, mean),
                                       (layer.moving_variance, variance)):
                        # Python floats, as Keras: a float32 0.99 is 1e-8 off in float64
                        var.assign(var * layer.momentum
                                   + tf.cast(value, var.dtype) * (1.0 - layer.momentum))


def normalized(layer: Any, x: Any, mean: Any, variance: Any) -> Any:
    """Keras' BatchNormalization output for float input ``x`` and the given moments
    (``keras.layers.BatchNormalization.call``'s training branch, renorm aside)."""
    gamma = tf.cast(layer.gamma, x.dtype) if layer.scale else None
    beta = tf.cast(layer.beta, x.dtype) if layer.center else None
    out = keras.ops.batch_normalization(x, tf.cast(mean, x.dtype), tf.cast(variance, x.dtype),
                                        axis=layer.axis, offset=beta, scale=gamma,
                                        epsilon=layer.epsilon)
    return tf.cast(out, layer.compute_dtype)


def global_moments(layer: Any, parts: Sequence[Any], devices: Sequence[str | None]
                   ) -> tuple[Any, Any]:
    """The mean and (biased) variance of ``layer``'s input over every part of the step
    (``parts``: its input per part; ``devices``: where each part's layer runs, None for
    wherever tf.distribute puts it), all-reduced across the replicas of a strategy.

    Two passes, as ``tf.nn.moments`` computes them on one device: the mean, then the
    mean squared deviation from it (its gradient through the stopped mean is zero,
    since the deviations sum to zero over the whole batch)."""
    xs = [as_float(x) for x in parts]
    axes = reduction_axes(layer, len(xs[0].shape))
    ctx = tf.distribute.get_replica_context()
    sync = ctx is not None and ctx.num_replicas_in_sync > 1

    def total(values: list[Any]) -> Any:
        with tf.device(devices[0] or ""):
            s = tf.add_n(values) if len(values) > 1 else values[0]
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, s) if sync else s

    sums, counts = [], []
    for x, device in zip(xs, devices):
        with tf.device(device or ""):
            sums.append(tf.reduce_sum(x, axes))
            counts.append(tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype))
    count = total(counts)
    mean = total(sums) / count
    squares = []
    for x, device in zip(xs, devices):
        with tf.device(device or ""):
            squares.append(tf.reduce_sum(tf.square(x - tf.stop_gradient(mean)), axes))
    return mean, total(squares) / count


@contextlib.contextmanager
def stepping(mode: str | None) -> Iterator[StepStats | None]:
    """The current train step's ``StepStats`` (None when ``mode`` is None: a model
    without BatchNormalization layers)."""
    if mode is None:
        yield None
        return
    stats = StepStats(mode)
    token = _STEP.set(stats)
    try:
        yield stats
    finally:
        _STEP.reset(token)
