"""BatchNormalization on the SPMD engine: the statistics of the whole step's batch, summed
over the data-parallel group, as one device computes them (the plan's ``global`` rule).

Pipeline position: ``apply.spmd.copies`` swaps every BatchNormalization layer of a copy for
a ``GroupBatchNormalization`` over its device's data-parallel group (on the layer's pipeline
chunk) when the step has several parts (dp > 1, or micro-batches under ``local``);
``SpmdModel``'s train step opens ``moving_statistics``; ``planner.batch_stats``
prices the all-reduces (SyncBatchNorm, as PyTorch's and Keras' ``synchronized=True``).

In training, each device sums its rows' ``x`` (and their count) per channel; one all-reduce
over the group gives the batch mean, a second the sum of squared deviations from it (two
passes, as ``tf.nn.moments``), so mean and biased variance are one device's over the
global batch. Both sums are collectives whose backward all-reduces the gradient too: a
replica's loss share reaches the statistics, and through them every replica's rows. The
moving statistics move once per step with those values, identically on every replica
(Keras' rule: moving = moving x momentum + batch x (1 - momentum)). Outside training, or
in a group of one, the layer is Keras' own. Masked inputs and ``renorm`` are refused
(``apply.wrap.spmd_refusal`` sends ``renorm`` and subclasses to the older engine first).

Over micro-batches the ``global`` rule needs every micro-batch's rows at each layer before any
continues, forward and backward (``planner.batch_stats``' barrier): the engine runs each
replica's micro-batches as one (``apply.spmd.run.describe``: ``joined_microbatches``), which
is the barrier's order (each stage runs all of them before the next starts) and holds what
it holds (every micro-batch's activations, GPipe's).

Under the plan's ``local`` rule each part (replica and micro-batch) normalises its rows with
their own statistics (Keras' layer, GPipe's and MirroredStrategy's rule): no collective in
the loss or its gradient. Inside a step the parts' batch statistics are recorded
(``moving_statistics``) and the moving statistics move once per step, after the forward,
with their mean over every part: the micro-batches' on the device, then one all-reduce of
the 2 C values per layer over the data-parallel group (``planner.traffic``), so every
replica keeps one value (Keras' rule is linear in the batch value: one update with the
mean is the mean of the parts' updates).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import keras
import tensorflow as tf
from keras import ops

from tfplan import compat
from tfplan.apply.collective_ops import member_all_reduce
from tfplan.apply.groups import Group
from tfplan.apply.spmd.megatron import conjugate
from tfplan.core.errors import PlannerError


def summed(x: Any, group: Group, device: str) -> Any:
    """The sum of every member's ``x``; its gradient is the sum of every member's gradient
    (each member's loss share depends on the sum)."""

    def total(v: Any) -> Any:
        return member_all_reduce(v, group, device, "dp")

    return conjugate(x, total, total)


class GroupBatchNormalization(keras.layers.BatchNormalization):
    """A BatchNormalization whose training statistics are those of its group's whole
    batch (module docstring)."""

    def __init__(self, group: Group, device: str, local: bool = False, **config: Any) -> None:
        self.group, self.device, self.local = group, device, local
        super().__init__(**config)

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if not training or not self.trainable:
            return super().call(inputs, training=training, mask=mask)
        if self.local:
            return self._local_call(inputs, mask)
        if self.group.size == 1:
            return super().call(inputs, training=training, mask=mask)
        if mask is not None or self.renorm:
            raise PlannerError(
                f"BatchNormalization {self.name!r} gets a Keras mask or uses renorm; the SPMD "
                "engine sums plain statistics over the data-parallel replicas. Use a plan "
                "with batch_norm 'local' (plan analyze --batch-norm local) or with dp=1.")
        x = ops.cast(inputs, "float32")
        rank = len(x.shape)
        axis = self.axis % rank
        axes = [i for i in range(rank) if i != axis]
        shape = [1] * rank
        shape[axis] = x.shape[axis]
        rows = ops.cast(ops.prod(ops.take(ops.shape(x), axes)), "float32")
        sums = summed(ops.concatenate([ops.sum(x, axis=axes), ops.reshape(rows, (1,))]),
                      self.group, self.device)
        count = sums[-1]
        mean = sums[:-1] / count
        deviation = x - ops.reshape(mean, shape)
        variance = summed(ops.sum(ops.square(deviation), axis=axes), self.group,
                          self.device) / count
        for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            moving.assign(moving * self.momentum + ops.cast(batch, moving.dtype)
                          * (1.0 - self.momentum))
        gamma = None if self.gamma is None else ops.cast(self.gamma, "float32")
        beta = None if self.beta is None else ops.cast(self.beta, "float32")
        out = ops.batch_normalization(x, mean, variance, axis=axis, offset=beta, scale=gamma,
                                      epsilon=self.epsilon)
        return ops.cast(out, self.compute_dtype)


    def _local_call(self, inputs: Any, mask: Any) -> Any:
        """``local``: normalised with this part's own statistics (Keras' layer); inside a
        step they are recorded for the one update of the moving statistics
        (``moving_statistics``), outside one Keras' own update."""
        step = _STEP.get()
        if step is None:
            return super().call(inputs, training=True, mask=mask)
        x = ops.cast(inputs, "float32")
        mean, variance = compat.batch_norm_moments(self, x, mask)  # Keras' own
        step.record(self, mean, variance)
        gamma = None if self.gamma is None else ops.cast(self.gamma, "float32")
        beta = None if self.beta is None else ops.cast(self.beta, "float32")
        out = ops.batch_normalization(x, mean, variance, axis=self.axis, offset=beta,
                                      scale=gamma, epsilon=self.epsilon)
        return ops.cast(out, self.compute_dtype)


class MovingStatistics:
    """The batch statistics a step's parts recorded under ``local``, by layer, and their one
    update of the moving statistics (module docstring)."""

    def __init__(self) -> None:
        self._parts: dict[int, tuple[GroupBatchNormalization, list[Any]]] = {}

    def record(self, layer: GroupBatchNormalization, mean: Any, variance: Any) -> None:
        stats = tf.stop_gradient(ops.concatenate([ops.reshape(mean, (-1,)),  # (Keras
                                                  ops.reshape(variance, (-1,))]))  # squeezes)
        self._parts.setdefault(id(layer), (layer, []))[1].append(stats)

    def update(self) -> None:
        """Each recorded layer's moving statistics moved once, with the mean of every part's
        (its micro-batches' on its device, then over its data-parallel group)."""
        for layer, parts in self._parts.values():
            with tf.device(layer.device):
                mean = ops.mean(ops.stack(parts), axis=0)
                if layer.group.size > 1:
                    mean = member_all_reduce(mean, layer.group, layer.device, "dp") \
                        / float(layer.group.size)
                n = int(layer.moving_mean.shape[0])
                for v, batch in ((layer.moving_mean, mean[:n]),
                                 (layer.moving_variance, mean[n:])):
                    v.assign(v * layer.momentum + ops.cast(batch, v.dtype)
                             * (1.0 - layer.momentum))
        self._parts.clear()


_STEP: contextvars.ContextVar[MovingStatistics | None] = contextvars.ContextVar(
    "tfplan_spmd_moving_statistics", default=None)


@contextlib.contextmanager
def moving_statistics() -> Iterator[MovingStatistics]:
    """Inside a train step: ``local`` layers record their parts' statistics here; call
    ``update()`` once the step's forwards have run."""
    step = MovingStatistics()
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def group_batch_norm(layer: Any, group: Group, device: str, local: bool = False
                     ) -> GroupBatchNormalization:
    """The group's twin of a Keras BatchNormalization ``layer`` (its config, unbuilt);
    ``local``: each replica's own statistics (module docstring)."""
    return GroupBatchNormalization(group, device, local=local, **layer.get_config())


def is_batch_norm(layer: Any) -> bool:
    return type(layer) is keras.layers.BatchNormalization


def has_batch_norm(model: Any) -> bool:
    """True when ``model`` has a BatchNormalization layer at any depth."""
    return any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in compat.flatten_layers(model))
