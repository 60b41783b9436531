"""Context parallelism's layers: which run on a sequence chunk alone, and attention over
the chunks of a context-parallel group.

Pipeline position: ``apply.context_parallel`` calls ``check_context_parallel_model`` when
it wraps a model (before any copy is built) and ``group_attention`` for every attention
layer of its layer-by-layer forward pass.

Context parallelism cuts every sample's sequence (axis 1 of every input) into cp equal
chunks, one per rank, and runs each layer on its rank's chunk. That equals one device
only for layers that treat each position on its own; attention is the one layer here
that mixes positions, and it is run over the group (``group_attention``). So
``check_context_parallel_model`` accepts a model built of

* per-position layers (``ELEMENTWISE``: activations, dropout, merges, embeddings) and
  elementwise ``keras.ops`` calls (``ELEMENTWISE_OPS``: ``x + y``, ``ops.exp``, ...);
* per-feature layers acting on the last axis (``LAST_AXIS``: Dense, EinsumDense whose
  equation keeps the sequence axis, normalizations and softmax over features,
  Concatenate of features), on inputs of rank 3 or more so the last axis is not the
  sequence;
* ``keras.layers.MultiHeadAttention`` over rank-3 inputs, attending along the sequence
  axis, with no explicit ``attention_mask``, gate, sliding window or returned scores;
  ``use_causal_mask`` and Keras padding masks (``Embedding(mask_zero=True)``,
  ``Masking``) are applied. ``GroupedQueryAttention`` is refused: its projections have
  no public accessors, and ``tfplan.compat`` has none for them yet;

and refuses anything else, naming the layer (Flatten, pooling, Conv1D across time, a
position embedding computed from a chunk's own positions, a nested model, ...), as well
as inputs without a sequence axis and outputs that lose it (a loss that is not per
position). The chunks' losses are combined weighted by their positions
(``apply.context_parallel``).

Attention exchanges keys and values by an all-gather, not Megatron-LM's ring: each rank
projects the keys and values of its own chunk, and rank c concatenates, on its device,
the projected keys and values of the ranks whose positions it may see: ranks 0..c under
a causal mask (a later chunk's keys are all masked for it), every rank otherwise or when
the queries carry a padding mask (a padded query then attends as on one device). Per
attention layer, a causal group moves ``c`` chunks of keys and values into rank c,
``cp (cp - 1) / 2`` chunks of ``2 * batch * (seq / cp) * heads * key_dim`` values in
all, ``cp (cp - 1)`` without the causal mask (plus the chunks' padding masks, ``batch *
seq / cp`` booleans each, when there are some); the backward pass sends the gradients of
the same keys and values back (the gradient of the concatenation, summed on the owning
rank by ``tf.gradients``). Megatron-LM's ring passes every chunk around all cp ranks in
cp - 1 steps overlapped with the attention math (``cp (cp - 1)`` chunks), with a zigzag
chunk order that balances the causal work, which here is unbalanced (rank c attends over
c + 1 chunks). The causal mask is built from global positions: query i of chunk c
(position ``c * L + i``) sees key position ``j <= c * L + i``; padding masks follow
Keras' rule (``MultiHeadAttention._compute_attention_mask``: query & value & key masks)
over the gathered keys.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.core.errors import PlannerError
from tfplan.layers.moe import MixtureOfExperts
from tfplan.profiler.split_rules import einsum_specs

ELEMENTWISE = (
    keras.layers.InputLayer, keras.layers.Activation, keras.layers.ReLU, keras.layers.ELU,
    keras.layers.LeakyReLU, keras.layers.Dropout, keras.layers.GaussianNoise,
    keras.layers.GaussianDropout, keras.layers.AlphaDropout, keras.layers.Identity,
    keras.layers.Add, keras.layers.Subtract, keras.layers.Multiply, keras.layers.Average,
    keras.layers.Maximum, keras.layers.Minimum, keras.layers.Embedding, keras.layers.Masking,
)
# keras.ops calls that act on each element alone (their Operation class names)
ELEMENTWISE_OPS = frozenset({
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Negative", "Abs", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Power", "Maximum", "Minimum", "Cast", "Tanh", "Sigmoid",
    "Relu", "Gelu", "Silu", "Softplus", "Erf",
})
LAST_AXIS = (
    keras.layers.Dense, keras.layers.EinsumDense, keras.layers.LayerNormalization,
    keras.layers.UnitNormalization, keras.layers.Softmax, keras.layers.Concatenate,
)
ATTENTION = (keras.layers.MultiHeadAttention,)
_RMS = getattr(keras.layers, "RMSNormalization", None)
if _RMS is not None:
    LAST_AXIS = LAST_AXIS + (_RMS,)

_FIX = ("Context parallelism runs models whose layers act on each position alone "
        "(apply.context_layers lists them) plus attention; re-plan with cp=1 (plan analyze "
        "--fix cp=1), or build the model from those layers.")


def check_context_parallel_model(model: Any, cp: int, plan_name: str) -> None:
    """PlannerError naming the first layer, input or output of ``model`` (a Functional)
    that cutting the sequence into ``cp`` chunks would change (module docstring)."""
    seq = _check_inputs(model, cp, plan_name)
    for operation in model.operations:  # layers and keras.ops calls
        _check_layer(operation, plan_name)
    for out in model.outputs:
        shape = tuple(out.shape)
        if len(shape) < 2 or shape[1] != seq:
            raise PlannerError(
                f"Plan {plan_name!r} splits the sequence over cp={cp} ranks, but model "
                f"{model.name!r}'s output {out.name!r} has shape {shape}, not (batch, "
                f"sequence={seq}, ...): its layers pool or flatten the sequence, so its loss "
                "is not per position and no rank can compute its chunk's part. " + _FIX)


def _check_inputs(model: Any, cp: int, plan_name: str) -> int | None:
    lengths = set()
    for x in model.inputs:
        shape = tuple(x.shape)
        if len(shape) < 2:
            raise PlannerError(
                f"Plan {plan_name!r} splits every input's axis 1 (the sequence) over cp={cp} "
                f"ranks, but model input {x.name!r} has shape {shape}, with no sequence "
                "axis. Give every input a sequence axis, or re-plan with cp=1.")
        lengths.add(shape[1])
    if len(lengths) != 1:
        raise PlannerError(
            f"Model inputs have sequence lengths {sorted(lengths, key=str)}; context "
            f"parallelism (plan {plan_name!r}) cuts one sequence, so every input needs the "
            "same length on axis 1. Re-plan with cp=1.")
    seq = lengths.pop()
    if seq is not None and seq % cp:
        raise PlannerError(
            f"Model {model.name!r} takes sequences of {seq} positions, which plan "
            f"{plan_name!r} cannot cut into cp={cp} equal chunks. Use a sequence length "
            f"that is a multiple of {cp}, or a plan whose cp divides {seq}.")
    return seq


def _check_layer(layer: Any, plan_name: str) -> None:
    def refuse(why: str) -> None:
        raise PlannerError(
            f"Plan {plan_name!r} splits the sequence over context-parallel ranks, but "
            f"layer {layer.name!r} ({type(layer).__name__}) {why}. " + _FIX)

    if not isinstance(layer, keras.layers.Layer):  # a keras.ops call in the graph
        if type(layer).__name__ not in ELEMENTWISE_OPS:
            refuse("is not known to act on each position alone; it may mix or pick "
                   "positions along the sequence axis, which context parallelism cuts")
        return
    if isinstance(layer, keras.layers.GroupQueryAttention):
        refuse("is not run context-parallel yet (MultiHeadAttention is)")
    if isinstance(layer, keras.Model):
        refuse("is a nested model; apply checks and splits top-level layers only "
               "(flatten the model)")
    nodes = compat.inbound_nodes(layer)
    ranks = {len(t.shape) for node in nodes for t in node.input_tensors}
    if isinstance(layer, ATTENTION):
        _check_attention(layer, nodes, refuse)
        return
    if isinstance(layer, ELEMENTWISE):
        return
    if isinstance(layer, MixtureOfExperts):  # routes each token alone; its capacity and
        if min(ranks, default=3) < 3:  # aux loss per group of tokens (apply.wrap warns)
            refuse(f"routes the positions of a rank-{min(ranks)} input, not tokens")
        return
    if not isinstance(layer, LAST_AXIS):
        refuse("is not known to act on each position alone; it may mix positions along "
               "the sequence axis, which context parallelism cuts")
    if min(ranks, default=3) < 3:
        refuse(f"acts on the last axis of a rank-{min(ranks)} input, which is the sequence")
    if isinstance(layer, keras.layers.EinsumDense):
        _check_einsum(layer, refuse)
        return
    axes = getattr(layer, "axis", -1)
    for rank in ranks:
        for axis in (axes if isinstance(axes, (list, tuple)) else [axes]):
            if axis % rank < 2:
                refuse(f"acts along axis {axis} of its rank-{rank} input (the batch or the "
                       "sequence)")


def _check_einsum(layer: Any, refuse: Callable[[str], None]) -> None:
    inputs, kernel, output = einsum_specs(layer.equation)
    if "..." in inputs:
        if "..." not in output:
            refuse(f"has equation {layer.equation!r}, which drops the leading axes")
        return  # the sequence is inside the ellipsis (input rank >= 3 was checked)
    seq = inputs[1]
    if seq in kernel or output.find(seq) != 1:
        refuse(f"has equation {layer.equation!r}, which contracts or moves the sequence "
               f"axis {seq!r}")


def _check_attention(layer: Any, nodes: list[Any], refuse: Callable[[str], None]) -> None:
    config = layer.get_config()
    signature = inspect.signature(layer.call)
    calls = [signature.bind_partial(*node.arguments.args, **node.arguments.kwargs).arguments
             for node in nodes]
    ranks = {len(a[name].shape) for a in calls for name in ("query", "value", "key")
             if a.get(name) is not None}
    if ranks != {3}:
        refuse(f"attends over inputs of rank {sorted(ranks)}; context parallelism runs "
               "attention over (batch, sequence, features) only")
    if config.get("attention_axes") not in (None, 1, (1,), [1]):
        refuse(f"attends along axes {config['attention_axes']}, not the sequence alone")
    if compat.attention_settings(layer).use_gate or config.get("sliding_window") is not None:
        refuse("has a gate or a sliding window, which the context-parallel attention does "
               "not apply")
    for arguments in calls:
        if arguments.get("attention_mask") is not None:
            refuse("is called with attention_mask, a (query, key) mask that apply does not "
                   "cut into chunks yet (use_causal_mask and Keras padding masks are "
                   "applied)")
        if arguments.get("return_attention_scores"):
            refuse("returns its attention scores, whose key axis spans the whole sequence")


class _Call:
    """One rank's call of an attention layer: its chunk's tensors and masks (Keras masks
    of the inputs, or the call's own ``*_mask`` arguments, as ``MultiHeadAttention.call``
    reads them)."""

    def __init__(self, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        a = inspect.signature(layer.call).bind(*args, **kwargs).arguments
        self.query, self.value = a["query"], a["value"]
        self.key = self.value if a.get("key") is None else a["key"]
        self.causal = bool(a.get("use_causal_mask", False))
        self.training = a.get("training")
        self.query_mask = compat.get_keras_mask(self.query)
        self.value_mask = _first(a.get("value_mask"), compat.get_keras_mask(self.value))
        self.key_mask = None if a.get("key") is None else _first(
            a.get("key_mask"), compat.get_keras_mask(self.key))
        for t in (self.query, self.value, self.key):  # as MultiHeadAttention.call does (the
            compat.set_keras_mask(t, None)  # next layers then see what they see on one device)


def _first(*masks: Any) -> Any:
    return next((m for m in masks if m is not None), None)


def _causal_mask(chunk: int, query_len: Any, key_len: Any) -> Any:
    """[1, query_len, key_len]: query ``i`` of chunk ``chunk`` (global position
    ``chunk * query_len + i``) sees key position ``j`` (global, from 0) when ``j <=`` it."""
    rows = chunk * query_len + tf.range(query_len)
    return (rows[:, None] >= tf.range(key_len)[None, :])[None]


def _mask(c: int, call: _Call, seen: list[_Call], query_len: Any, key_len: Any) -> Any:
    """Rank c's [B or 1, query_len, key_len] boolean mask over the gathered keys of the
    ranks ``seen`` (Keras' rule: query mask & value mask & key mask & causal), or None."""
    parts = []
    if call.query_mask is not None:
        parts.append(tf.cast(call.query_mask, tf.bool)[:, :, None])
    for attr in ("value_mask", "key_mask"):
        masks = [getattr(other, attr) for other in seen]
        if all(m is not None for m in masks):
            parts.append(tf.concat([tf.cast(m, tf.bool) for m in masks], axis=1)[:, None, :])
    if call.causal:
        parts.append(_causal_mask(c, query_len, key_len))
    mask = None
    for part in parts:
        mask = part if mask is None else tf.logical_and(mask, part)
    return mask


def group_attention(layers: Sequence[Any], devices: Sequence[str | None],
                    args: Sequence[tuple[Any, ...]], kwargs: Sequence[dict[str, Any]],
                    calls: Sequence[Callable[[Callable[..., Any]], Callable[..., Any]]]
                    ) -> list[Any]:
    """The outputs of one attention layer over a context-parallel group: ``layers[c]``
    (rank c's copy, on ``devices[c]``) called with ``args[c]``/``kwargs[c]`` (its chunk).
    ``calls[c]`` wraps rank c's local attention (its query projection, attention over
    the gathered keys and values, output projection), e.g. to recompute it.

    Under a causal mask without a query mask, rank c gathers ranks 0..c only: every
    chunk has the same length (the model check makes every input's sequence one length),
    so later chunks hold only keys it may not see. A query mask keeps every rank: a
    padded query whose keys are all masked attends, as on one device, over the whole
    sequence unmasked (Keras' softmax mask is then a constant shift)."""
    cp = len(layers)
    parts = [_Call(layer, a, k) for layer, a, k in zip(layers, args, kwargs)]
    keys, values = [], []
    for layer, device, call in zip(layers, devices, parts):
        with tf.device(device), tf.name_scope(layer.name):  # its own chunk's keys/values
            keys.append(layer.key_dense(call.key))
            values.append(layer.value_dense(call.value))
    outputs = []
    for c, (layer, device, call) in enumerate(zip(layers, devices, parts)):
        prefix = call.causal and call.query_mask is None
        ranks = list(range(c + 1 if prefix else cp))

        def local(q_in: Any, k_all: Any, v_all: Any, layer: Any = layer, c: int = c,
                  call: _Call = call, ranks: list[int] = ranks) -> Any:
            q = layer.query_dense(q_in)
            mask = _mask(c, call, [parts[s] for s in ranks], tf.shape(q)[1],
                         tf.shape(k_all)[1])
            out, _ = compat.attention_scores(layer, q, k_all, v_all, mask, call.training,
                                             False)
            return layer.output_dense(out)

        with tf.device(device), tf.name_scope(layer.name):  # all-gather: what c may see
            k_all = tf.concat([keys[s] for s in ranks], axis=1)
            v_all = tf.concat([values[s] for s in ranks], axis=1)
            out = calls[c](local)(call.query, k_all, v_all)
        if call.query_mask is not None:  # as MultiHeadAttention: the output keeps it
            compat.set_keras_mask(out, call.query_mask)
        outputs.append(out)
    return outputs
