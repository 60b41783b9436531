"""What every sharded layer shares: its split, its tensor-parallel devices, its unsplit weights.

Pipeline position: the base of ``apply.sharded_layers`` (Dense, EinsumDense,
convolutions, Embedding) and ``apply.sharded_attention`` (attention split by heads),
which ``apply.tensor_parallel`` re-creates the plan's split layers with. ``Sharded``
is mixed into a subclass of the Keras layer; ``row_output`` finishes a layer whose
ranks each computed a partial sum of its output.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from keras import ops

from tfplan.apply.sequence_parallel import join, reduce_scatter, splittable


class Sharded:
    """What every sharded layer shares: its split, its devices and unsplit weights."""

    tp_split: str
    tp_devices: tuple[str, ...]
    # sequence parallelism (apply.sequence_parallel): gather sequence-sharded inputs,
    # reduce-scatter partial sums into sequence pieces; set by sharded_clone
    sequence_parallel = False

    def _init_tp(self, tp_split: str, tp_devices: Sequence[str]) -> None:
        self.tp_split = tp_split
        self.tp_devices = tuple(tp_devices)

    def _add_shards(self, name: str, shapes: Sequence[tuple[int, ...]], initializer: Any,
                    regularizer: Any = None, constraint: Any = None) -> list[Any]:
        out = []
        for t, (shape, d) in enumerate(zip(shapes, self.tp_devices)):
            with tf.device(d):
                out.append(self.add_weight(name=f"{name}_{t}", shape=tuple(shape),
                                           initializer=initializer, regularizer=regularizer,
                                           constraint=constraint))
        return out

    # unsplit weights, in the original layer's order ------------------------------------
    def full_weights(self) -> list[np.ndarray]:
        raise NotImplementedError

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        raise NotImplementedError

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        """Each unsplit weight (``full_weights``' order) as (its shard variables, the axis
        they are concatenated along, or None for one unsplit variable): how
        ``apply.checkpoint`` joins and splits their optimizer slots."""
        raise NotImplementedError

    def get_weights(self) -> list[np.ndarray]:
        return self.full_weights()

    def set_weights(self, weights: Sequence[Any]) -> None:
        self.set_full_weights([np.asarray(w) for w in weights])

    def save_own_variables(self, store: Any) -> None:
        if self.built:
            for i, w in enumerate(self.full_weights()):
                store[str(i)] = w

    def load_own_variables(self, store: Any) -> None:
        self.set_full_weights([np.asarray(store[str(i)]) for i in range(len(store.keys()))])


def assign_pieces(variables: Sequence[Any], full: np.ndarray, axis: int) -> None:
    """Assign ``full`` cut along ``axis`` in the variables' sizes, piece t to variables[t]."""
    sizes = [v.shape[axis] for v in variables]
    for v, piece in zip(variables, np.split(full, np.cumsum(sizes)[:-1], axis=axis)):
        v.assign(piece)


def concat_variables(variables: Sequence[Any], axis: int) -> np.ndarray:
    """The variables' values joined along ``axis`` (an unsplit weight, as numpy)."""
    return np.concatenate([np.asarray(v.numpy()) for v in variables], axis=axis)


def row_output(layer: Any, partial: list[Any], bias: Any, activation: Any = None, *,
                per_token: bool = True) -> Any:
    """The sum of a row split's (or attention's, or an embedding's) ``partial`` outputs,
    then ``bias`` and ``activation``: on the layer's device, or, with sequence
    parallelism, reduce-scattered into sequence pieces that each rank finishes."""
    if not (per_token and layer.sequence_parallel and splittable(partial[0], len(partial))):
        y = tf.add_n(partial)
        if bias is not None:
            y = ops.add(y, bias)
        return y if activation is None else activation(y)
    pieces = reduce_scatter(partial, layer.tp_devices)
    for t, d in enumerate(layer.tp_devices):
        with tf.device(d):
            if bias is not None:
                pieces[t] = ops.add(pieces[t], bias)
            if activation is not None:
                pieces[t] = activation(pieces[t])
    return join(pieces)
