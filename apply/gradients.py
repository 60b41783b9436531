"""Summing the gradients that several data-parallel copies of one weight computed.

Pipeline position: the bottom of ``apply``'s replicated updates: ``apply.tensor_parallel``
(each copy of a weight gets the sum, on its own device), ``apply.zero`` (the sum on the
owner's device) and ``apply.spmd.zero`` (micro-batches' shards) call ``sum_gradients``
under the device the sum belongs on.
"""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf


def sum_gradients(grads: Sequence[Any]) -> Any:
    """The sum of ``grads`` in their order: ``tf.add_n``, or, when all are
    ``tf.IndexedSlices``, their rows concatenated (sparse stays sparse, as Adam treats it)."""
    if all(isinstance(g, tf.IndexedSlices) for g in grads):
        return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                                tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in grads])
