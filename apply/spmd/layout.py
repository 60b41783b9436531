"""The layout of a device's copy: which tensors of its graph are cut, and where they meet.

Pipeline position: ``apply.spmd.copies`` re-wires the graph of each copy with split
layers (a Functional model's top level) through ``GraphLayout.call``, the
``call_function`` of ``keras.models.clone_model``. Two kinds of cut tensors, each rank
holding its own piece:

* **Cut along the hidden (last) axis**: a column split's output (``apply.spmd.
  rank_layers``: rank t's slice of the units). It stays cut where a row split reads it
  (Megatron's pair: no communication) or a pass-through layer all of whose inputs are cut
  (``planner.traffic.PASS_THROUGH_TYPES``: SwiGLU's ``gate * up`` runs on the slices, its
  output cut too); every other reader, and a model output, reads it all-gathered
  (``HiddenWhole``, once per tensor; the planner prices the same:
  ``planner.traffic.gathered_outputs``).
* **Cut along the sequence (axis 1)**, under sequence parallelism (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2.2):
  a row, heads or vocabulary split's output is rank t's piece t of tp equal pieces (g-bar)
  and those splits all-gather a piece they read (f-bar). In between, a per-token layer
  the plan does not split (``apply.sequence_parallel.token_wise``: LayerNormalization
  over the last axis, RMS-scaled too, RMSNormalization, Dropout, the merge layers,
  elementwise activations, Softmax over the last axis) with a piece among its inputs runs
  on pieces: a whole input (one every rank holds, e.g. a residual from before the first
  split) is cut to the rank's piece first (``SequencePiece``: no communication forward,
  the pieces' gradients all-gathered back), and its output is a piece. Any other layer or
  operation (one that mixes positions: Flatten, pooling, a position embedding, an
  unsplit Dense, a ``keras.ops`` call), and a model output, reads pieces all-gathered
  (``SequenceWhole``: the rank's piece of the replicated gradient back). The weights read
  on pieces (such a layer's own, and a row or heads split's bias added after g-bar) get
  each rank's piece's gradient: ``SpmdModel`` sums them over the tp group
  (``summed_over_tp``; Megatron-LM all-reduces the layer norms' gradients the same way).

The activations between split layers and the per-token layers' work are 1/tp per rank
under sequence parallelism; the communication is tp's all-reduces' (an all-reduce is a
reduce-scatter and an all-gather), plus the all-gathers above where a layer mixing
positions reads a piece. Dropout draws each rank's mask for its own piece, so its random
masks differ from one device's (losses match without dropout). A Keras mask (``[batch,
seq]``, e.g. an Embedding's ``mask_zero``) stays whole on the pieces: the layers that run
on pieces pass it on without reading it, f-bar's gathered tensor and every gathered
output carry it as they are, and a per-token layer that reads it (Softmax) runs gathered.
"""
from __future__ import annotations

import inspect
from typing import Any

import keras

from tfplan import compat
from tfplan.apply.groups import Group
from tfplan.apply.sequence_parallel import token_wise
from tfplan.apply.spmd.megatron import (SEQ_AXIS, gather_from_sequence, gather_from_tp,
                                        scatter_to_sequence)
from tfplan.apply.spmd.rank_layers import is_twin
from tfplan.planner.traffic import PASS_THROUGH_TYPES

Where = tuple[Group, str]  # a piece's tp group and the rank's device in it


class _Layout(keras.layers.Layer):
    """A layer of the layout (no weights): rank ``device`` of the ``group``."""

    def __init__(self, group: Group, device: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group, self.device = group, device
        self.supports_masking = True  # a Keras mask passes through whole (module docstring)
        self.built = True


class SequencePiece(_Layout):
    """A whole tensor cut to the rank's sequence piece (``megatron.scatter_to_sequence``)."""

    def call(self, x: Any) -> Any:
        return scatter_to_sequence(x, self.group, self.device)

    def compute_output_shape(self, shape: Any) -> Any:
        return (shape[0], shape[1] // self.group.size, *shape[2:])


class SequenceWhole(_Layout):
    """The sequence pieces all-gathered (``megatron.gather_from_sequence``)."""

    def call(self, x: Any) -> Any:
        return gather_from_sequence(x, self.group, self.device)

    def compute_output_shape(self, shape: Any) -> Any:
        return (shape[0], shape[1] * self.group.size, *shape[2:])


class HiddenWhole(_Layout):
    """The last-axis slices all-gathered (``megatron.gather_from_tp``)."""

    def call(self, x: Any) -> Any:
        return gather_from_tp(x, self.group, self.device)

    def compute_output_shape(self, shape: Any) -> Any:
        return (*shape[:-1], shape[-1] * self.group.size)


def is_layout_layer(layer: Any) -> bool:
    """Whether ``layer`` is one the layout added (not one of the model's)."""
    return isinstance(layer, _Layout)


def _pass_through(layer: Any) -> bool:
    kind = type(layer).__name__
    return kind in PASS_THROUGH_TYPES and type(layer) is getattr(keras.layers, kind, None) \
        and (kind != "Dropout" or layer.noise_shape is None)


class GraphLayout:
    """The ``call_function`` that re-wires one copy's graph (module docstring).
    ``sequence``: the plan runs sequence parallelism. ``cut`` / ``pieces``: id of each
    symbolic tensor cut along its last axis / its sequence -> where its rank is;
    ``weights``: those read on sequence pieces."""

    def __init__(self, sequence: bool) -> None:
        self.sequence = sequence
        self.cut: dict[int, Where] = {}
        self.pieces: dict[int, Where] = {}
        self.weights: list[Any] = []
        self._kept: list[Any] = []  # the tensors keyed by id, alive while re-wiring
        self._gathered: dict[int, Any] = {}  # one HiddenWhole per cut tensor

    def call(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        flat = _symbolic(keras.tree.flatten((args, kwargs)))
        cut = [self.cut[id(x)] for x in flat if id(x) in self.cut]
        if cut and _pass_through(layer) and len(cut) == len(flat):
            out = layer(*args, **kwargs)
            self._mark(self.cut, out, cut[0])
            return out
        if cut and not (is_twin(layer) and layer.tp_rank.split == "row"):
            args, kwargs = keras.tree.map_structure(self._hidden_whole, (args, kwargs))
            flat = _symbolic(keras.tree.flatten((args, kwargs)))
        if is_twin(layer):
            out = layer(*args, **kwargs)
            r = layer.tp_rank
            if r.split == "column" and not r.gather_output:
                self._mark(self.cut, out, (r.group, r.device))
            elif layer.seq and r.split in ("row", "heads", "vocab"):
                self._mark(self.pieces, out, (r.group, r.device))
                self.weights.extend(layer.piece_weights())
            return out
        pieces = [self.pieces[id(x)] for x in flat if id(x) in self.pieces]
        if not pieces:
            return layer(*args, **kwargs)
        if token_wise(layer) and all(len(x.shape) > SEQ_AXIS for x in flat) and not (
                _reads_mask(layer) and any(compat.get_keras_mask(x) is not None for x in flat)):
            args, kwargs = keras.tree.map_structure(lambda x: self._piece(x, pieces[0]),
                                                    (args, kwargs))
            out = layer(*args, **kwargs)
            self._mark(self.pieces, out, pieces[0])
            self.weights.extend(layer.trainable_weights)
            return out
        args, kwargs = keras.tree.map_structure(self.whole, (args, kwargs))
        return layer(*args, **kwargs)

    def whole(self, x: Any) -> Any:
        """``x`` whole: all-gathered where it is cut or a sequence piece."""
        x = self._hidden_whole(x)
        if not isinstance(x, keras.KerasTensor) or id(x) not in self.pieces:
            return x
        return SequenceWhole(*self.pieces[id(x)])(x)

    def _hidden_whole(self, x: Any) -> Any:
        if not isinstance(x, keras.KerasTensor) or id(x) not in self.cut:
            return x
        if id(x) not in self._gathered:
            self._gathered[id(x)] = HiddenWhole(*self.cut[id(x)])(x)
        return self._gathered[id(x)]

    def _piece(self, x: Any, where: Where) -> Any:
        if not isinstance(x, keras.KerasTensor) or id(x) in self.pieces:
            return x
        out = SequencePiece(*where)(x)
        self._mark(self.pieces, out, where)
        return out

    def _mark(self, table: dict[int, Where], out: Any, where: Where) -> None:
        for x in _symbolic(keras.tree.flatten(out)):
            if table is self.cut or len(x.shape) > SEQ_AXIS:
                table[id(x)] = where
                self._kept.append(x)


def _reads_mask(layer: Any) -> bool:
    """Whether ``layer``'s call takes the Keras mask (Softmax does; LayerNormalization, the
    merge layers and Dropout pass it on without reading it)."""
    return "mask" in inspect.signature(layer.call).parameters


def _symbolic(values: list[Any]) -> list[Any]:
    return [x for x in values if isinstance(x, keras.KerasTensor)]


def summed_over_tp(grads: list[Any], variables: list[Any], on_pieces: frozenset[int],
                   group: Group, device: str) -> list[Any]:
    """``grads`` with those of the weights read on sequence pieces (ids in ``on_pieces``)
    summed over the tp ``group``, in one packed all-reduce per dtype (module docstring)."""
    import numpy as np
    import tensorflow as tf

    from tfplan.apply.collective_ops import member_all_reduce

    out = list(grads)
    by_dtype: dict[Any, list[int]] = {}
    for i, v in enumerate(variables):
        if id(v) in on_pieces and grads[i] is not None and group.size > 1:
            by_dtype.setdefault(grads[i].dtype, []).append(i)
    for indices in by_dtype.values():
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in indices], axis=0)
        summed = member_all_reduce(flat, group, device, "tp")
        sizes = [int(np.prod(grads[i].shape)) for i in indices]
        for i, piece in zip(indices, tf.split(summed, sizes)):
            out[i] = tf.reshape(piece, grads[i].shape)
    return out
