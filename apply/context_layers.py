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
  axis, with no Keras masks, explicit ``attention_mask``, gate, sliding window or
  returned scores (``GroupQueryAttention`` is refused: its projections have no public
  accessors, and ``tfplan.compat`` has none for them yet);

and refuses anything else, naming the layer (Flatten, pooling, Conv1D across time, a
position embedding computed from a chunk's own positions, a nested model, a Keras mask,
...), as well as inputs without a sequence axis and outputs that lose it (a loss that is
not per position). The losses of the chunks are combined weighted by their positions
(``apply.context_parallel``).

Attention exchanges keys and values by an all-gather, not Megatron-LM's ring: each rank
projects the keys and values of its own chunk, and rank c concatenates, on its device,
the projected keys and values of the ranks whose positions it may see -- ranks 0..c
under a causal mask (a later chunk's keys are all masked for it), every rank otherwise.
Per attention layer and sample a causal group moves ``c`` chunks of keys and values into
rank c, ``cp (cp - 1) / 2`` chunks of ``2 * (seq / cp) * heads * key_dim`` values in all
(twice that without the causal mask); the backward pass sends the gradients of the same
keys and values back (the ``tf.gradients`` of the concatenation, summed on the owning
rank). A ring would move the same bytes in cp - 1 steps overlapped with the attention
math, and Megatron-LM's zigzag chunk order balances the causal work, which here is
unbalanced (rank c attends over c + 1 chunks). The causal mask is built from global
positions: query i of chunk c (position ``c * L + i``) sees key position ``j <= c * L +
i``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.core.errors import PlannerError

ELEMENTWISE = (
    keras.layers.InputLayer, keras.layers.Activation, keras.layers.ReLU, keras.layers.ELU,
    keras.layers.LeakyReLU, keras.layers.Dropout, keras.layers.GaussianNoise,
    keras.layers.GaussianDropout, keras.layers.AlphaDropout, keras.layers.Identity,
    keras.layers.Add, keras.layers.Subtract, keras.layers.Multiply, keras.layers.Average,
    keras.layers.Maximum, keras.layers.Minimum, keras.layers.Embedding,
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
    if isinstance(layer, keras.layers.Embedding) and layer.mask_zero:
        refuse("makes a Keras padding mask (mask_zero=True), which apply does not carry "
               "across the chunks yet")
    nodes = compat.inbound_nodes(layer)
    ranks = {len(t.shape) for node in nodes for t in node.input_tensors}
    if isinstance(layer, ATTENTION):
        _check_attention(layer, nodes, ranks, refuse)
        return
    if isinstance(layer, ELEMENTWISE):
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
    inputs, rest = layer.equation.split(",")
    kernel, output = rest.split("->")
    if "..." in inputs:
        if "..." not in output:
            refuse(f"has equation {layer.equation!r}, which drops the leading axes")
        return  # the sequence is inside the ellipsis (input rank >= 3 was checked)
    seq = inputs[1]
    if seq in kernel or output.find(seq) != 1:
        refuse(f"has equation {layer.equation!r}, which contracts or moves the sequence "
               f"axis {seq!r}")


def _check_attention(layer: Any, nodes: list[Any], ranks: set[int],
                     refuse: Callable[[str], None]) -> None:
    config = layer.get_config()
    if ranks != {3}:
        refuse(f"attends over inputs of rank {sorted(ranks)}; context parallelism runs "
               "attention over (batch, sequence, features) only")
    if config.get("attention_axes") not in (None, 1, (1,), [1]):
        refuse(f"attends along axes {config['attention_axes']}, not the sequence alone")
    if config.get("use_gate") or config.get("sliding_window") is not None:
        refuse("has a gate or a sliding window, which the context-parallel attention does "
               "not apply")
    signature = inspect.signature(layer.call)
    for node in nodes:
        bound = signature.bind_partial(*node.arguments.args, **node.arguments.kwargs)
        given = [name for name in ("attention_mask", "query_mask", "value_mask", "key_mask")
                 if bound.arguments.get(name) is not None]
        if given:
            refuse(f"is called with {given[0]}, a mask over the whole sequence that apply "
                   "does not cut into chunks yet (use_causal_mask is applied)")
        if bound.arguments.get("return_attention_scores"):
            refuse("returns its attention scores, whose key axis spans the whole sequence")


def _attention_call(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any, Any, Any, bool, Any]:
    """(query, value, key, use_causal_mask, training) of one call of ``layer``."""
    bound = inspect.signature(layer.call).bind(*args, **kwargs)
    a = bound.arguments
    value = a["value"]
    key = a.get("key")
    return a["query"], value, value if key is None else key, bool(
        a.get("use_causal_mask", False)), a.get("training")


def _causal_mask(chunk: int, query_len: Any, key_len: Any) -> Any:
    """[1, query_len, key_len]: query ``i`` of chunk ``chunk`` (global position
    ``chunk * query_len + i``) sees key position ``j`` (global, from 0) when ``j <=`` it."""
    rows = chunk * query_len + tf.range(query_len)
    return (rows[:, None] >= tf.range(key_len)[None, :])[None]


def group_attention(layers: Sequence[Any], devices: Sequence[str | None],
                    args: Sequence[tuple[Any, ...]], kwargs: Sequence[dict[str, Any]],
                    calls: Sequence[Callable[[Callable[..., Any]], Callable[..., Any]]]
                    ) -> list[Any]:
    """The outputs of one attention layer over a context-parallel group: ``layers[c]``
    (rank c's copy, on ``devices[c]``) called with ``args[c]``/``kwargs[c]`` (its chunk).
    ``calls[c]`` wraps rank c's local attention (its query projection, attention over
    the gathered keys and values, output projection), e.g. to recompute it."""
    cp = len(layers)
    unpacked = [_attention_call(layer, a, k) for layer, a, k in zip(layers, args, kwargs)]
    keys, values = [], []
    for layer, device, (query, value, key, causal, training) in zip(layers, devices, unpacked):
        with tf.device(device), tf.name_scope(layer.name):  # its own chunk's keys/values
            keys.append(layer.key_dense(key))
            values.append(layer.value_dense(value))
    outputs = []
    for c, (layer, device, (query, value, key, causal, training)) in enumerate(
            zip(layers, devices, unpacked)):
        same_length = query.shape[1] is not None and query.shape[1] == key.shape[1]
        ranks = range(c + 1) if causal and same_length else range(cp)

        def local(q_in: Any, k_all: Any, v_all: Any, layer: Any = layer, c: int = c,
                  causal: bool = causal, training: Any = training) -> Any:
            q = layer.query_dense(q_in)
            mask = _causal_mask(c, tf.shape(q)[1], tf.shape(k_all)[1]) if causal else None
            out, _ = compat.attention_scores(layer, q, k_all, v_all, mask, training, False)
            return layer.output_dense(out)

        with tf.device(device), tf.name_scope(layer.name):  # all-gather: what c may see
            k_all = tf.concat([keys[s] for s in ranks], axis=1)
            v_all = tf.concat([values[s] for s in ranks], axis=1)
            outputs.append(calls[c](local)(query, k_all, v_all))
    return outputs

