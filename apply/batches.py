"""Batches: their size, and splitting one into equal parts along the batch axis.

Pipeline position: the bottom of ``apply``'s models: ``apply.planned_model`` checks
every training batch and splits it into micro-batches with these, the replicated modes
(``apply.tensor_parallel``) split it over their replicas, and
``apply.auto`` offers the nearest batch sizes that split when one does not.
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

KERAS_DEFAULT_BATCH_SIZE = 32  # what fit() uses for arrays when batch_size is None
RUNTIME_BATCH_CHECK = "apply: batch size not a multiple of the micro-batch count:"


def nearest_multiples(size: int, m: int) -> str:
    """The multiples of ``m`` around ``size``, as an error message offers them."""
    lower, upper = (size // m) * m, (size // m + 1) * m
    return f"{lower} or {upper}" if lower else f"{upper}"


def leading_dim(x: Any) -> int | None:
    """The batch size of an array structure or a TensorSpec structure (None if unknown)."""
    if x is None:
        return None
    try:
        leaves = keras.tree.flatten(x)
    except (TypeError, ValueError):
        return None
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            dim = shape[0]
            return None if dim is None else int(dim)
    return None


def split_microbatches(data: tuple[Any, Any, Any], m: int,
                       error: Any) -> list[tuple[Any, Any, Any]]:
    """Split (x, y, sample_weight) along the batch axis into ``m`` equal parts."""
    if m == 1:
        return [data]
    first = keras.tree.flatten(data[0])[0]
    static = first.shape[0]
    if static is not None:
        if static % m:
            raise error(int(static), "A training batch (per replica)")
        checks = []
    else:
        n = tf.shape(first)[0]
        checks = [tf.debugging.Assert(tf.equal(n % m, 0), [RUNTIME_BATCH_CHECK, n])]
    with tf.control_dependencies(checks):
        columns = [_split_structure(part, m) for part in data]
    return [tuple(column[i] for column in columns) for i in range(m)]


def concat_batches(parts: list[Any]) -> Any:
    """The inverse of a split: equal structures of tensors joined along the batch axis."""
    return keras.tree.map_structure(lambda *t: tf.concat(t, axis=0), *parts)


def _split_structure(part: Any, m: int) -> list[Any]:
    if part is None:
        return [None] * m
    pieces = [tf.split(t, m, axis=0) for t in keras.tree.flatten(part)]
    return [keras.tree.pack_sequence_as(part, [p[i] for p in pieces]) for i in range(m)]
