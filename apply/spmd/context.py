"""Context parallelism on the SPMD engine: each copy runs one chunk of every sample's
sequence, its attention reading every chunk's keys and values.

Pipeline position: ``apply.spmd.copies`` swaps each top-level MultiHeadAttention of a
copy for its ``ContextAttention`` twin where the plan has ``cp`` > 1, and
``SpmdModel`` cuts each replica's rows into chunks (``chunk_of``) and joins the outputs
back (``joined``). Megatron-Core's context parallelism (Liu et al. 2023, "Ring
Attention", all-gather form):

* Replica q = r cp + c (data-parallel rank r, context rank c: ``planner.plan``'s device
  order) holds a whole copy of the model and runs chunk c of its data-parallel part's
  sequences: axis 1 of every input, target and per-position weight whose axis 1 is the
  model's sequence, cut into cp equal, contiguous chunks. Every layer but attention acts
  on each position alone (``apply.context_layers.check_context_parallel_model`` refuses
  the others, naming them), so it computes its chunk's part of the one-device result.
* Attention projects its chunk's queries, keys and values, all-gathers the keys and
  values over the plan's ``cp`` group (the backward reduce-scatters their gradients to
  the chunk that made them), and attends with the causal mask at global positions
  (query i of chunk c is position c L + i) and the Keras padding masks of the gathered
  keys (all-gathered too, no gradient).
* The loss of each chunk is weighed by its share of the positions (``SpmdModel``'s
  counts, summed over the dp group, which holds every dp x cp replica), and the
  gradients are summed over that group, so the copies train as one device. The pricing
  is ``planner.traffic``'s ``cp``: per attention layer and micro-batch the gather of its
  keys and values forward and their reduce-scatter backward.
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops

from tfplan import compat
from tfplan.apply.groups import Group
from tfplan.apply.spmd.megatron import all_gather_sequence
from tfplan.core.errors import PlannerError

SEQ_AXIS = 1


class ContextAttention(keras.layers.MultiHeadAttention):
    """Rank ``index`` of the ``cp`` group's MultiHeadAttention (module docstring): the
    unsplit layer's weights, attention over every chunk's keys and values."""

    def __init__(self, group: Group, device: str, **config: Any) -> None:
        super().__init__(**config)
        self.cp_group, self.cp_device = group, device

    @property
    def index(self) -> int:
        return self.cp_group.devices.index(self.cp_device)

    def call(self, query: Any, value: Any, key: Any = None, query_mask: Any = None,
             value_mask: Any = None, key_mask: Any = None, attention_mask: Any = None,
             return_attention_scores: bool = False, training: Any = None,
             use_causal_mask: bool = False) -> Any:
        group, device = self.cp_group, self.cp_device
        key = value if key is None else key
        query_mask = compat.get_keras_mask(query)  # as MultiHeadAttention.call reads them
        value_mask = compat.get_keras_mask(value) if value_mask is None else value_mask
        key_mask = compat.get_keras_mask(key) if key_mask is None else key_mask
        for x in (query, value, key):
            compat.set_keras_mask(x, None)
        q = self.query_dense(query)
        k = all_gather_sequence(self.key_dense(key), group, device, "cp")
        v = all_gather_sequence(self.value_dense(value), group, device, "cp")
        mask = context_mask(group, device, ops.shape(q)[1], ops.shape(k)[1], query_mask,
                            value_mask, key_mask, use_causal_mask)
        out, scores = compat.attention_scores(self, q, k, v, mask, training,
                                              return_attention_scores)
        y = self.output_dense(out)
        if query_mask is not None:
            compat.set_keras_mask(y, query_mask)
        return (y, scores) if return_attention_scores else y


def context_mask(group: Group, device: str, query_len: Any, key_len: Any, query_mask: Any,
                 value_mask: Any, key_mask: Any, causal: bool) -> Any:
    """Rank ``device``'s [B or 1, query_len, key_len] attention mask over every chunk's
    keys: Keras' rule (query mask & value mask & key mask & causal) with the keys' masks
    gathered over the cp ``group`` and the causal mask at global positions (query i of
    chunk c is position c query_len + i); None without masks."""
    parts = []
    if query_mask is not None:
        parts.append(ops.cast(query_mask, "bool")[:, :, None])
    for m in (value_mask, key_mask):
        if m is not None:
            parts.append(_gathered_mask(m, group, device)[:, None, :])
    if causal:
        rows = group.devices.index(device) * query_len + ops.arange(query_len)
        parts.append((rows[:, None] >= ops.arange(key_len)[None, :])[None])
    mask = None
    for part in parts:
        mask = part if mask is None else ops.logical_and(mask, part)
    return mask


def _gathered_mask(mask: Any, group: Group, device: str) -> Any:
    """Every chunk's [B, L] Keras mask joined along the sequence (no gradient)."""
    ints = tf.cast(mask, tf.int32)[:, :, None]  # (a gather moves rank >= 2 along axis 1)
    return tf.cast(all_gather_sequence(ints, group, device, "cp", differentiable=False),
                   tf.bool)[:, :, 0]


def context_twin(layer: Any, group: Group, device: str) -> ContextAttention:
    """Rank ``device``'s twin of the MultiHeadAttention ``layer`` (unbuilt)."""
    from tfplan.profiler.signature import layer_config

    return ContextAttention(group, device, **layer_config(layer))


def chunk_of(data: Any, seq: int, cp: int, c: int) -> Any:
    """Chunk c of ``data`` (a nested structure of tensors): axis 1 of every tensor whose
    axis 1 is the model's sequence (``seq`` positions) cut into cp equal chunks; others
    (per-sample weights, tensors without the sequence) as they are."""
    size = seq // cp

    def cut(t: Any) -> Any:
        if t is None or len(t.shape) < 2 or t.shape[SEQ_AXIS] != seq:
            return t
        return t[:, c * size:(c + 1) * size]

    return tf.nest.map_structure(cut, data)


def joined(chunks: list[Any], seq: int) -> Any:
    """A replica's outputs from its cp chunks' (``chunk_of``'s inverse), on the current
    device: each output whose axis 1 is a chunk joined along it."""
    cp = len(chunks)

    def join(*ts: Any) -> Any:
        if len(ts[0].shape) < 2 or ts[0].shape[SEQ_AXIS] is None \
                or ts[0].shape[SEQ_AXIS] * cp != seq:
            return ts[0]
        out = ops.concatenate(ts, axis=SEQ_AXIS)
        masks = [compat.get_keras_mask(t) for t in ts]
        if all(m is not None for m in masks):  # a Keras mask joined along with it
            compat.set_keras_mask(out, ops.concatenate(masks, axis=SEQ_AXIS))
        return out

    return tf.nest.map_structure(join, *chunks)


PER_POSITION_REDUCTIONS = ("sum_over_batch_size", "mean")  # mean: Keras 2's name


def check_loss_reduction(loss: Any, plan_name: str, cp: int) -> None:
    """PlannerError for a compiled loss whose reduction is not a mean over positions: the
    chunks' losses are combined as one (module docstring)."""
    for fn in keras.tree.flatten(loss) if loss is not None else ():
        reduction = getattr(fn, "reduction", "sum_over_batch_size")
        if reduction not in PER_POSITION_REDUCTIONS:
            raise PlannerError(
                f"compile() received loss {getattr(fn, 'name', fn)!r} with reduction "
                f"{reduction!r}; plan {plan_name!r} cuts every sequence into cp={cp} chunks "
                "and combines the chunks' losses as a mean over positions, which needs "
                "reduction='sum_over_batch_size' (Keras' default). Use that reduction, or "
                "re-plan with cp=1.")
