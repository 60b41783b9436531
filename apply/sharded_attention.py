"""Attention split by heads (MultiHeadAttention, GroupQueryAttention), each rank's heads on
its tensor-parallel device.

Pipeline position: ``apply.sharded_layers.sharded_clone`` re-creates a plan's ``heads``
split layer as one of these (Megatron-LM, Shoeybi et al. 2019, Sec. 3: each rank
holds its heads' Q, K, V and output projections, so self-attention needs one sum of
the ranks' outputs, where the output bias is added). With sequence parallelism
(``apply.sequence_parallel``) each rank gathers a sequence-sharded input and the sum
is reduce-scattered into sequence pieces instead. Weights read and write unsplit:
the projections' entries (``query_dense``, ...) save the unsplit layer's arrays.
keras_hub's CachedMultiHeadAttention (GPT-2's blocks) splits the same way
(``ShardedCachedMultiHeadAttention``: training calls, no key/value cache). A custom
attention block (keras_hub's ``LlamaAttention``) splits by heads in
``apply.sharded_attention_block``, which reuses ``ProjectionEntry``.
"""
from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfplan import compat
from tfplan.apply.sequence_parallel import Gathered, shard_sizes
from tfplan.apply.sharded_base import Sharded, assign_pieces, concat_variables, row_output
from tfplan.core.errors import PlannerError


class ProjectionEntry(keras.layers.Layer):
    """Stands in, in weight files, for one of an attention layer's EinsumDense sub-layers
    (``query_dense``, ...): it saves and loads that projection's unsplit kernel and bias."""

    def __init__(self, read: Any, write: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._read, self._write = read, write  # functions: not tracked by Keras
        self.built = True

    def save_own_variables(self, store: Any) -> None:
        for i, w in enumerate(self._read()):
            store[str(i)] = w

    def load_own_variables(self, store: Any) -> None:
        self._write([np.asarray(store[str(i)]) for i in range(len(store.keys()))])


class _ShardedHeads(Sharded):
    """What attention split by heads shares (MultiHeadAttention, GroupQueryAttention):
    ``shards`` {"query", "key", "value", "output" and their "_bias"es: one variable per
    rank}, ``output_bias`` on the layer's device, and the projections' unsplit weights in
    the unsplit layer's sub-layer entries (``query_dense``, ...)."""

    shards: dict[str, list[Any]]
    use_bias: bool

    def _add_projection_entries(self) -> None:
        for part in compat.ATTENTION_PROJECTIONS:
            compat.set_attention_projection(self, part, ProjectionEntry(
                lambda part=part: self._projection(part),
                lambda weights, part=part: self._set_projection(part, weights), name=part))

    def _projection(self, part: str) -> list[np.ndarray]:
        """One projection's unsplit [kernel, bias] (as the unsplit layer's EinsumDense)."""
        s, b = self.shards, self.use_bias
        if part == "output":
            return [concat_variables(s["output"], 0)] + ([self.output_bias.numpy()] if b else [])
        return [concat_variables(s[part], 1)] + ([concat_variables(s[part + "_bias"], 0)] if b else [])

    def _set_projection(self, part: str, weights: Sequence[Any]) -> None:
        s = self.shards
        if part == "output":
            assign_pieces(s["output"], weights[0], 0)
            if self.use_bias:
                self.output_bias.assign(weights[1])
            return
        assign_pieces(s[part], weights[0], 1)
        if self.use_bias:
            assign_pieces(s[part + "_bias"], weights[1], 0)

    # weight files: the projections' entries above hold the weights, as in the unsplit layer
    def save_own_variables(self, store: Any) -> None:
        pass

    def load_own_variables(self, store: Any) -> None:
        pass

    def full_weights(self) -> list[np.ndarray]:
        return [w for part in ("query", "key", "value", "output") for w in self._projection(part)]

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        s, out = self.shards, []
        for part in ("query", "key", "value"):
            out.append((tuple(s[part]), 1))
            if self.use_bias:
                out.append((tuple(s[part + "_bias"]), 0))
        out.append((tuple(s["output"]), 0))
        if self.use_bias:
            out.append(((self.output_bias,), None))
        return out

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        n = 2 if self.use_bias else 1
        for i, part in enumerate(("query", "key", "value", "output")):
            self._set_projection(part, weights[i * n:(i + 1) * n])

    def _project(self, t: int, query: Any, key: Any, value: Any, whole: Any) -> tuple:
        """Rank t's projected (query, key, value) of its heads, on the current device;
        ``whole`` gathers sequence-sharded inputs there (``apply.sequence_parallel``)."""
        s = self.shards
        q = ops.einsum("abc,cde->abde", whole(query, t), s["query"][t])
        k = ops.einsum("abc,cde->abde", whole(key, t), s["key"][t])
        v = ops.einsum("abc,cde->abde", whole(value, t), s["value"][t])
        if self.use_bias:
            q, k, v = q + s["query_bias"][t], k + s["key_bias"][t], v + s["value_bias"][t]
        return q, k, v

    def _output(self, partial: list[Any], query_mask: Any) -> Any:
        """The sum of the ranks' output projections plus the output bias (reduce-scattered
        into sequence pieces with sequence parallelism), carrying ``query_mask``."""
        bias = self.output_bias if self.use_bias else None
        if query_mask is not None:  # the mask goes on one whole tensor
            y = tf.add_n(partial)
            y = y if bias is None else y + bias
            compat.set_keras_mask(y, query_mask)
            return y
        return row_output(self, partial, bias)


class ShardedMultiHeadAttention(_ShardedHeads, keras.layers.MultiHeadAttention):
    """MultiHeadAttention split by heads: rank t holds heads [lo_t, hi_t) of Q, K, V and
    the output projection; the output bias sits on the layer's device."""

    def __init__(self, num_heads: int, key_dim: int, *, tp_split: str = "heads",
                 tp_devices: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(num_heads, key_dim, **kwargs)
        self._init_tp(tp_split, tp_devices)

    def build(self, query_shape: Any, value_shape: Any, key_shape: Any = None) -> None:
        key_shape = value_shape if key_shape is None else key_shape
        ranks = {len(query_shape), len(value_shape), len(key_shape)}
        settings = compat.attention_settings(self)
        out_shape = settings.output_shape
        if isinstance(out_shape, (tuple, list)) and len(out_shape) == 1:
            out_shape = out_shape[0]
        if settings.use_gate or ranks != {3} or self.attention_axes not in (
                None, (1,), [1]) or not (out_shape is None or isinstance(out_shape, int)):
            raise PlannerError(
                f"MultiHeadAttention layer {self.name!r} cannot be split by heads yet: apply "
                "splits attention over inputs of rank 3 (batch, sequence, features), "
                "without use_gate, custom attention_axes or a multi-axis output_shape. "
                "Re-plan with that layer replicated (remove it from tp_splits).")
        out_dim = int(out_shape or query_shape[-1])
        self.sizes = sizes = shard_sizes(self.num_heads, len(self.tp_devices))
        b = self.use_bias
        kw, bw = settings.kernel, settings.bias
        dq, dk, dv = int(query_shape[-1]), int(key_shape[-1]), int(value_shape[-1])
        kd, vd = self.key_dim, self.value_dim
        self.shards = {
            "query": self._add_shards("query_kernel", [(dq, h, kd) for h in sizes], **kw),
            "key": self._add_shards("key_kernel", [(dk, h, kd) for h in sizes], **kw),
            "value": self._add_shards("value_kernel", [(dv, h, vd) for h in sizes], **kw),
            "output": self._add_shards("output_kernel", [(h, vd, out_dim) for h in sizes],
                                       **kw)}
        if b:
            self.shards["query_bias"] = self._add_shards("query_bias", [(h, kd) for h in sizes],
                                                         **bw)
            self.shards["key_bias"] = self._add_shards("key_bias", [(h, kd) for h in sizes], **bw)
            self.shards["value_bias"] = self._add_shards("value_bias", [(h, vd) for h in sizes],
                                                         **bw)
            self.output_bias = self.add_weight(name="output_bias", shape=(out_dim,), **bw)
        compat.build_attention(self, 4)
        self._add_projection_entries()
        self.built = True

    def call(self, query: Any, value: Any, key: Any = None, query_mask: Any = None,
             value_mask: Any = None, key_mask: Any = None, attention_mask: Any = None,
             return_attention_scores: bool = False, training: Any = None,
             use_causal_mask: bool = False) -> Any:
        if key is None:
            key = value
        query_mask = compat.get_keras_mask(query)
        attention_mask = compat.attention_mask(
            self, query, value, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask, use_causal_mask=use_causal_mask)
        return self._heads(query, key, value, attention_mask, query_mask, training,
                           return_attention_scores)

    def _heads(self, query: Any, key: Any, value: Any, attention_mask: Any, query_mask: Any,
               training: Any, return_attention_scores: bool) -> Any:
        """Each rank's heads on its device (Keras' own attention arithmetic), their output
        projections summed on the layer's device."""
        s, partial, scores = self.shards, [], []
        whole = Gathered(self.tp_devices)
        for t, d in enumerate(self.tp_devices):
            with tf.device(d):
                q, k, v = self._project(t, query, key, value, whole)
                out, score = compat.attention_scores(self, q, k, v, attention_mask, training,
                                                     return_attention_scores)
                partial.append(ops.einsum("abcd,cde->abe", out, s["output"][t]))
                scores.append(score)
        y = self._output(partial, query_mask)
        if return_attention_scores:
            return y, tf.concat(scores, axis=1)
        return y


class ShardedGroupQueryAttention(_ShardedHeads, keras.layers.GroupQueryAttention):
    """GroupQueryAttention split by heads: rank t holds num_query_heads/tp query heads and
    the num_key_value_heads/tp key/value heads they read (Keras repeats key/value head j
    for query heads j*r .. j*r + r - 1, r = num_query_heads / num_key_value_heads, so
    contiguous slices of both stay matched), and their slice of the output projection;
    the output bias sits on the layer's device. tp must divide num_key_value_heads
    (``sharded_clone`` refuses otherwise). The attention itself is Keras' computation
    with public ops: ``ops.dot_product_attention`` with scale 1/sqrt(head_dim), or the
    explicit softmax when the scores are returned."""

    def __init__(self, head_dim: int, num_query_heads: int, num_key_value_heads: int, *,
                 tp_split: str = "heads", tp_devices: Sequence[str] = (),
                 **kwargs: Any) -> None:
        super().__init__(head_dim, num_query_heads, num_key_value_heads, **kwargs)
        self._init_tp(tp_split, tp_devices)

    def build(self, query_shape: Any, value_shape: Any, key_shape: Any = None) -> None:
        key_shape = value_shape if key_shape is None else key_shape
        tp = len(self.tp_devices)
        ranks = {len(query_shape), len(value_shape), len(key_shape)}
        if self.use_gate or self.dropout > 0 or ranks != {3}:
            raise PlannerError(
                f"GroupQueryAttention layer {self.name!r} cannot be split by heads yet: apply "
                "splits grouped-query attention over inputs of rank 3 (batch, sequence, "
                "features), without use_gate or dropout. Re-plan with that layer replicated "
                "(remove it from tp_splits).")
        q_heads = shard_sizes(self.num_query_heads, tp)
        kv_heads = shard_sizes(self.num_key_value_heads, tp)
        self.sizes = q_heads
        kw = dict(initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
                  constraint=self.kernel_constraint)
        bw = dict(initializer=self.bias_initializer, regularizer=self.bias_regularizer,
                  constraint=self.bias_constraint)
        hd, out_dim = self.head_dim, int(query_shape[-1])
        dq, dk, dv = int(query_shape[-1]), int(key_shape[-1]), int(value_shape[-1])
        self.shards = {
            "query": self._add_shards("query_kernel", [(dq, h, hd) for h in q_heads], **kw),
            "key": self._add_shards("key_kernel", [(dk, h, hd) for h in kv_heads], **kw),
            "value": self._add_shards("value_kernel", [(dv, h, hd) for h in kv_heads], **kw),
            "output": self._add_shards("output_kernel", [(h, hd, out_dim) for h in q_heads],
                                       **kw)}
        if self.use_bias:
            for part, heads in (("query", q_heads), ("key", kv_heads), ("value", kv_heads)):
                self.shards[part + "_bias"] = self._add_shards(
                    part + "_bias", [(h, hd) for h in heads], **bw)
            self.output_bias = self.add_weight(name="output_bias", shape=(out_dim,), **bw)
        self._add_projection_entries()
        self.built = True

    def call(self, query: Any, value: Any, key: Any = None, query_mask: Any = None,
             value_mask: Any = None, key_mask: Any = None, attention_mask: Any = None,
             return_attention_scores: bool = False, training: Any = None,
             use_causal_mask: bool = False) -> Any:
        if key is None:
            key = value
        query_mask = compat.get_keras_mask(query) if query_mask is None else query_mask
        mask = compat.attention_mask(
            self, query, value, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask, use_causal_mask=use_causal_mask)
        if mask is not None:  # [B or 1, T, S] -> [B or 1, 1, T, S] (all heads)
            mask = ops.cast(ops.expand_dims(mask, axis=-3), "bool")
        scale = 1.0 / float(np.sqrt(self.head_dim))
        repeats = self.num_query_heads // self.num_key_value_heads
        s, partial, scores = self.shards, [], []
        whole = Gathered(self.tp_devices)
        for t, d in enumerate(self.tp_devices):
            with tf.device(d):
                q, k, v = self._project(t, query, key, value, whole)
                k, v = ops.repeat(k, repeats, axis=2), ops.repeat(v, repeats, axis=2)
                if return_attention_scores:  # Keras' explicit path: softmax(q k / sqrt(h))
                    score = ops.einsum("bquh,bkuh->buqk", q * scale, k)
                    if mask is not None:  # as keras.layers.Softmax with a mask
                        score = ops.where(mask, score, ops.full_like(score, -1e9))
                    score = ops.softmax(score, axis=-1)
                    if mask is not None:  # a query row masked whole attends to nothing
                        score = ops.where(mask, score, ops.zeros_like(score))
                    out = ops.einsum("buqk,bkuh->bquh", score, v)
                    scores.append(score)
                else:
                    out = ops.dot_product_attention(q, k, v, mask=mask, scale=scale)
                partial.append(ops.einsum("bquh,uhm->bqm", out, s["output"][t]))
        y = self._output(partial, query_mask)
        if return_attention_scores:
            return y, tf.concat(scores, axis=1)
        return y


class ShardedCachedMultiHeadAttention(ShardedMultiHeadAttention):
    """keras_hub's ``CachedMultiHeadAttention`` (a MultiHeadAttention whose ``call`` takes
    the block's ``attention_mask`` as it is, without Keras masks, and a key/value cache
    for generation) split by heads as ``ShardedMultiHeadAttention``. Training calls it with
    ``cache=None, cache_update_index=None``, which is all it runs: a cache (generation)
    is refused with a PlannerError; generate with the user's model and the weights the
    wrapped one saves."""

    def call(self, query: Any, value: Any, key: Any = None, attention_mask: Any = None,
             cache: Any = None, cache_update_index: Any = None,
             return_attention_scores: bool = False, training: Any = None) -> Any:
        if cache is not None or cache_update_index is not None:
            raise PlannerError(
                f"Attention layer {self.name!r} (keras_hub CachedMultiHeadAttention) is split "
                "by heads and was called with a key/value cache (generation); apply's split "
                "attention runs training and evaluation calls (cache=None, "
                "cache_update_index=None) only. Generate with the user's model: load the "
                "wrapped model's save_weights file into it.")
        if key is None:
            key = value
        return self._heads(query, key, value, attention_mask, None, training,
                           return_attention_scores)


CACHED_ATTENTION = ("keras_hub.src.layers.modeling.cached_multi_head_attention",
                    "CachedMultiHeadAttention")
"""(module, class) of keras_hub's CachedMultiHeadAttention, split by
``ShardedCachedMultiHeadAttention`` (matched by module and name: apply does not import
keras_hub)."""
ShardedCachedMultiHeadAttention.__module__, ShardedCachedMultiHeadAttention.__name__ = \
    CACHED_ATTENTION
