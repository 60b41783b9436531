"""BatchNormalization on the SPMD engine: the statistics of the whole step's batch, summed
over the data-parallel group, as one device computes them (the plan's ``global`` rule).

Pipeline position: ``apply.spmd.copies`` swaps every BatchNormalization layer of a copy for
a ``GroupBatchNormalization`` over its device's data-parallel group when the run
description's ``batch_stats`` is set (dp > 1, one micro-batch); ``planner.batch_stats``
prices the all-reduces (SyncBatchNorm, as PyTorch's and Keras' ``synchronized=True``).

In training, each device sums its rows' ``x`` (and their count) per channel; one all-reduce
over the group gives the batch mean, a second the sum of squared deviations from it (two
passes, as ``tf.nn.moments``), so mean and biased variance are one device's over the
global batch. Both sums are collectives whose backward all-reduces the gradient too: a
replica's loss share reaches the statistics, and through them every replica's rows. The
moving statistics move once per step with those values, identically on every replica
(Keras' rule: moving = moving x momentum + batch x (1 - momentum)). Outside training, or
in a group of one, the layer is Keras' own. Masked inputs and ``renorm`` are refused
(``apply.spmd.run.refusal`` sends such plans to the older engine first).

Under the plan's ``local`` rule (one micro-batch) each replica normalises its rows with their
own statistics (Keras' layer, GPipe's and MirroredStrategy's rule): no collective in the
loss or its gradient; the moving statistics move once per step with the mean over the
replicas of their batch statistics, one forward all-reduce of the 2 C values per layer
(``planner.traffic``), so every replica keeps one value.
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops

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
        if not training or not self.trainable or self.group.size == 1:
            return super().call(inputs, training=training, mask=mask)
        if self.local:
            return self._local_call(inputs, mask)
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
        """``local``: normalised with this replica's own statistics (Keras' layer), the
        moving statistics moved once with the mean of the replicas' (one all-reduce of
        mean and variance, forward only), so every replica keeps the same values."""
        out = super().call(inputs, training=True, mask=mask)  # moves them by its own batch
        # Keras' rule, moving' = moving m + batch (1 - m), is linear in the batch value:
        # the mean over the replicas of each one's moving' is one update with their mean
        moving = (self.moving_mean, self.moving_variance)
        stats = ops.concatenate([ops.cast(ops.convert_to_tensor(v), "float32")
                                 for v in moving])  # read after the layer's own update
        mean = member_all_reduce(tf.stop_gradient(stats), self.group, self.device, "dp") \
            / float(self.group.size)
        n = int(self.moving_mean.shape[0])
        for v, value in zip(moving, (mean[:n], mean[n:])):
            v.assign(ops.cast(value, v.dtype))
        return out


def group_batch_norm(layer: Any, group: Group, device: str, local: bool = False
                     ) -> GroupBatchNormalization:
    """The group's twin of a Keras BatchNormalization ``layer`` (its config, unbuilt);
    ``local``: each replica's own statistics (module docstring)."""
    return GroupBatchNormalization(group, device, local=local, **layer.get_config())


def is_batch_norm(layer: Any) -> bool:
    return type(layer) is keras.layers.BatchNormalization
