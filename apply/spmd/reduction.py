"""The data-parallel gradient sum of the SPMD engine without ZeRO: every member receives
the whole sum (``apply.spmd.zero`` cuts it into shards instead).

Pipeline position: called by ``SpmdModel``'s step (``apply.spmd.model``) for each device's
gradients, and by ``apply.spmd.zero`` for sparse gradients, which are gathered there too.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tfplan.apply.collective_ops import member_all_gather, member_all_reduce


def reduced(grads: list[Any], variables: list[Any], group: Any, device: str) -> list[Any]:
    """The sum over ``group`` of every gradient: dense ones in one packed all-reduce per
    dtype; ``tf.IndexedSlices`` (an embedding's rows) all-gathered, so they stay sparse as
    one device's are (Keras' Adam squares a sparse gradient's rows before summing
    duplicates: densifying them would change its update)."""
    out: list[Any] = list(grads)
    by_dtype: dict[Any, list[int]] = {}
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            out[i] = gathered_slices(g, group, device)
        else:
            by_dtype.setdefault(g.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in indices], axis=0)
        summed = member_all_reduce(flat, group, device, "dp")
        sizes = [int(np.prod(variables[i].shape)) for i in indices]
        for i, piece in zip(indices, tf.split(summed, sizes)):
            out[i] = tf.reshape(piece, variables[i].shape)
    return out


def gathered_slices(g: Any, group: Any, device: str) -> Any:
    """Every member's rows of a sparse gradient, as one device's would be: all-gathered
    (padded to the longest with zero rows at id 0: adding zeros changes no update) and
    concatenated where each member looked up its own rows' ids (tokens); summed row by
    row where every member looked up the same ids (a lookup that does not depend on the
    rows, as positions: one device looks them up once)."""
    n = group.size
    rows = tf.shape(g.indices)[0]
    counts = member_all_gather(tf.reshape(rows, [1]), group, device, "dp")
    longest = tf.reduce_max(counts)
    pad = longest - rows
    values = tf.pad(g.values, [[0, pad]] + [[0, 0]] * (len(g.values.shape) - 1))
    indices = tf.pad(g.indices, [[0, pad]])
    values = member_all_gather(values, group, device, "dp")
    indices = member_all_gather(indices, group, device, "dp")
    per_member = tf.reshape(indices, [n, longest])
    same = tf.logical_and(tf.reduce_all(tf.equal(counts, counts[0])),
                          tf.reduce_all(tf.equal(per_member, per_member[:1])))
    width = tf.shape(values)[1:]

    def summed() -> tuple[Any, Any]:
        stacked = tf.reshape(values, tf.concat([[n, longest], width], 0))
        return tf.reduce_sum(stacked, axis=0), per_member[0]

    def joined() -> tuple[Any, Any]:
        return values, indices

    values, indices = tf.cond(same, summed, joined)
    return tf.IndexedSlices(values, indices, g.dense_shape)
