"""Sequence parallelism: the per-token layers between split layers run on 1/tp of the sequence.

Pipeline position: inside ``apply.tensor_parallel`` for a plan with ``tp > 1`` and
``strategy.sequence_parallel`` (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4.2.2). ``apply.sharded_layers``
uses the collectives below at the edges of its split layers; ``TensorParallelModel``
runs the replicated per-token layers through ``sequence_sharded``.

A tensor of shape [batch, seq, hidden] is *sequence-sharded* when it is the
concatenation along axis 1 of ``tp`` pieces, piece t on tensor rank t's device
(``shard_sizes`` of seq, the first ones one longer). In the graph it is one
``ConcatV2`` named ``sequence_shards``: a consumer that knows the layout takes the
pieces (``sequence_pieces``) and TensorFlow prunes the unused concatenation; any
other consumer reads the concatenation, i.e. the whole sequence gathered on its own
device, so it computes what it computes on one device. The layout:

* per-token layers (``token_wise``: LayerNormalization over the last axis, incl.
  ``rms_scaling=True``, RMSNormalization, Dropout without ``noise_shape``, the merge
  layers Add/Subtract/Multiply/Average/Maximum/Minimum, elementwise activations,
  Softmax over the last axis, not subclasses) that the plan does not split run once
  per rank, on that rank's device, on that rank's piece of every input
  (``sequence_sharded``); their output is sequence-sharded again. An input that is not
  sharded yet (the model's input, an unsplit layer's output) is cut on its producer's
  device and piece t is sent to rank t (a scatter). A layer whose inputs are not all
  [batch, seq, hidden] with the same static seq >= tp, or that carry a Keras mask,
  runs whole on rank 0 as without sequence parallelism; its name is added to
  ``TensorParallelModel.sequence_gathered``.
* elementwise layers (``token_wise`` "elementwise") whose inputs are all a column
  layer's output (tp pieces along the hidden axis: SwiGLU's ``gate * up``) run on
  those hidden pieces on their ranks instead, and the row layer after them takes the
  pieces (Megatron-LM's layout; no activation moves).
* before a column-parallel layer, or an attention split by heads, the sequence
  pieces are all-gathered: rank t concatenates all tp pieces on its own device
  (``gather``), (tp - 1)/tp of the activation arriving from the other ranks.
* after a row-parallel layer, attention's output projection, or a vocabulary-split
  embedding, the tp partial sums [batch, seq, out] are reduce-scattered
  (``reduce_scatter``), the bias (and activation) then added on each rank's piece.
* layers that mix positions outside attention (Flatten, pooling, convolutions,
  recurrent layers, position embeddings, an unsplit Dense, anything not listed above)
  are not run on pieces: they read the concatenation, i.e. they run gathered (on their
  stage's rank 0, as without sequence parallelism). They compute the one-device
  result; what they cost is an all-gather to rank 0.

Dropout (per-token layers and attention) draws one mask per piece, so its random masks
differ from one device's (losses match without dropout). The layout needs the traced
graph (``tf.function``, the default): under ``run_eagerly=True`` the pieces cannot be
found and every layer gathers (same numbers, more traffic).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Collection, Sequence

import keras
import tensorflow as tf

from tfplan import compat

SEQUENCE_SHARDS = "sequence_shards"  # name of the concatenation of sequence pieces
SEQ_AXIS = 1

# activations that act on each element alone (a column shard may apply its own; a
# per-token layer with one runs on sequence or hidden pieces)
ELEMENTWISE = frozenset((
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "silu", "swish", "tanh",
    "sigmoid", "hard_sigmoid", "hard_silu", "hard_swish", "softplus", "softsign",
    "exponential", "mish", "celu", "squareplus", "sparse_plus", "tanh_shrink", "hard_tanh",
    "soft_shrink", "hard_shrink", "threshold", "log_sigmoid",
    "gelu_approximate"))  # keras_hub.src.utils.keras_utils (GPT-2's): gelu(x, approximate=True)

# Keras layers that act on each position alone: "elementwise" on each element too (they
# may also run on hidden pieces), "token" over the last (hidden) axis
_ELEMENTWISE_LAYERS = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum",
                       "Dropout", "ReLU", "LeakyReLU", "ELU", "Identity")
_LAST_AXIS_LAYERS = ("LayerNormalization", "RMSNormalization", "Softmax")


def shard_sizes(n: int, tp: int) -> list[int]:
    """Sizes of ``tp`` nearly equal slices of ``n`` (the first ones one larger)."""
    return [n // tp + (1 if t < n % tp else 0) for t in range(tp)]


def elementwise(activation: Any) -> bool:
    """True for no activation or one of ``ELEMENTWISE``."""
    return activation is None or getattr(activation, "__name__", "") in ELEMENTWISE


def token_wise(layer: Any) -> str:
    """"elementwise", "token" (per position, over the hidden axis) or "" (mixes positions,
    or unknown: a subclass's ``call`` may differ) for a Keras layer."""
    kind = type(layer).__name__
    if type(layer) is not getattr(keras.layers, kind, None):
        return ""
    if kind == "Dropout":
        return "elementwise" if layer.noise_shape is None else ""
    if kind == "Activation":
        if elementwise(layer.activation):
            return "elementwise"
        return "token" if getattr(layer.activation, "__name__", "") == "softmax" else ""
    if kind in _ELEMENTWISE_LAYERS:
        return "elementwise"
    if kind in _LAST_AXIS_LAYERS:
        axis = layer.axis
        axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
        return "token" if axes in ((-1,), (2,)) else ""
    return ""


# --- the layout ------------------------------------------------------------------------------
def join(pieces: Sequence[Any]) -> Any:
    """The sequence-sharded tensor of ``pieces`` (a ``sequence_shards`` concatenation on the
    current device, computed only if a consumer reads it whole)."""
    return tf.concat(list(pieces), axis=SEQ_AXIS, name=SEQUENCE_SHARDS)


def sequence_pieces(x: Any, tp: int) -> list[Any] | None:
    """The ``tp`` pieces ``x`` was joined from (``join``), or None."""
    if tf.executing_eagerly() or not isinstance(x, tf.Tensor):
        return None
    op = x.op
    if op.type != "ConcatV2" or not op.name.rsplit("/", 1)[-1].startswith(SEQUENCE_SHARDS):
        return None
    pieces = list(op.inputs[:-1])
    return pieces if len(pieces) == tp else None


def hidden_pieces(x: Any, tp: int) -> list[Any] | None:
    """The ``tp`` pieces of a concatenation of ``x`` along its last axis (a column layer's
    output), or None."""
    if tf.executing_eagerly() or not isinstance(x, tf.Tensor):
        return None
    op = x.op
    if op.type != "ConcatV2" or len(op.inputs) != tp + 1 or x.shape.rank is None:
        return None
    axis = tf.get_static_value(op.inputs[-1])
    if axis is None or int(axis) not in (-1, x.shape.rank - 1):
        return None
    return list(op.inputs[:-1])


def splittable(x: Any, tp: int) -> bool:
    """``x`` is [batch, seq, hidden] with a static seq of at least ``tp``."""
    shape = getattr(x, "shape", None)
    return (shape is not None and shape.rank == 3 and shape[SEQ_AXIS] is not None
            and int(shape[SEQ_AXIS]) >= tp)


def scatter(x: Any, devices: Sequence[str]) -> list[Any]:
    """``x``'s sequence pieces, piece t for rank t: its own pieces if it is
    sequence-sharded, else cut on ``x``'s device (a scatter: piece t is sent to rank t)."""
    tp = len(devices)
    pieces = sequence_pieces(x, tp)
    sizes = shard_sizes(int(x.shape[SEQ_AXIS]), tp)
    if pieces is not None and [int(p.shape[SEQ_AXIS]) for p in pieces] == sizes:
        return pieces
    with tf.device(getattr(x, "device", "") or ""):
        return tf.split(x, sizes, axis=SEQ_AXIS)


def gather(x: Any, device: str, tp: int) -> Any:
    """All-gather's part on one rank: a sequence-sharded ``x`` concatenated on ``device``
    (each other rank's piece arrives there); any other tensor as it is."""
    pieces = sequence_pieces(x, tp)
    if pieces is None:
        return x
    with tf.device(device):
        return tf.concat(pieces, axis=SEQ_AXIS)


class Gathered:
    """Each rank's whole copy of its inputs, gathered once per tensor (attention's query,
    key and value are often one tensor)."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self._done: dict[tuple[int, int], Any] = {}

    def __call__(self, x: Any, t: int) -> Any:
        key = (id(x), t)
        if key not in self._done:
            self._done[key] = gather(x, self.devices[t], len(self.devices))
        return self._done[key]


def reduce_scatter(partials: Sequence[Any], devices: Sequence[str]) -> list[Any]:
    """The sum of ``partials`` (partials[k] on devices[k], [batch, seq, ...]) as sequence
    pieces, piece t summed on devices[t].

    TensorFlow has no reduce-scatter between devices of one process; this is its
    substitute: rank k cuts its partial sum into tp sequence pieces on its own device,
    piece t of every rank is sent to rank t, and rank t adds them (``tf.add_n``, in
    rank order). Each rank sends (tp - 1)/tp of its partial and receives as much, what
    a ring reduce-scatter moves; no rank ever holds the whole sum. Summing element by
    element in rank order, it gives exactly the pieces of ``tf.add_n(partials)``.
    """
    tp = len(devices)
    sizes = shard_sizes(int(partials[0].shape[SEQ_AXIS]), tp)
    cut = []
    for partial, d in zip(partials, devices):
        with tf.device(d):
            cut.append(tf.split(partial, sizes, axis=SEQ_AXIS))
    out = []
    for t, d in enumerate(devices):
        with tf.device(d):
            out.append(tf.add_n([cut[k][t] for k in range(tp)]))
    return out


# --- replicated per-token layers ------------------------------------------------------------
def sequence_sharded(layer: Any, fn: Callable[..., Any], devices: Sequence[str],
                     gathered: set[str]) -> Callable[..., Any]:
    """``fn`` (a call of the unsplit per-token ``layer``) run once per tensor rank on its
    pieces (module docstring); whole, with ``layer.name`` added to ``gathered``, when its
    inputs cannot be cut."""
    kind, tp = token_wise(layer), len(devices)

    def run(*args: Any, **kwargs: Any) -> Any:
        leaves = [x for x in keras.tree.flatten((args, kwargs))
                  if tf.is_tensor(x) and x.shape.rank]
        masked = kwargs.get("mask") is not None or any(
            compat.get_keras_mask(x) is not None for x in leaves)
        pieces = None if masked else _pieces_of(leaves, kind, tp, devices)
        if pieces is None:
            gathered.add(layer.name)
            return fn(*args, **kwargs)
        outs = []
        for t, d in enumerate(devices):
            rank_args, rank_kwargs = keras.tree.map_structure(
                lambda x, t=t: pieces[id(x)][t] if id(x) in pieces else x, (args, kwargs))
            with tf.device(d), tf.name_scope(f"rank_{t}"):
                outs.append(fn(*rank_args, **rank_kwargs))
        if not all(isinstance(o, tf.Tensor) for o in outs):
            gathered.add(layer.name)  # not one tensor out: run whole instead
            return fn(*args, **kwargs)
        if pieces.hidden:
            return tf.concat(outs, axis=-1)
        return join(outs)
    return run


class _Pieces(dict):
    """{id(input tensor): its tp pieces}; ``hidden``: cut along the hidden axis."""

    hidden = False


def _pieces_of(leaves: list[Any], kind: str, tp: int, devices: Sequence[str]
               ) -> _Pieces | None:
    if not leaves:
        return None
    out = _Pieces()
    if kind == "elementwise":  # all a column layer's outputs, cut alike: hidden pieces
        hidden = [hidden_pieces(x, tp) for x in leaves]
        if all(h is not None for h in hidden) and len({
                (tuple(x.shape.as_list()), tuple(int(p.shape[-1]) for p in h))
                for x, h in zip(leaves, hidden)}) == 1:
            out.update((id(x), h) for x, h in zip(leaves, hidden))
            out.hidden = True
            return out
    if not all(splittable(x, tp) for x in leaves):
        return None
    if len({tuple(x.shape.as_list()[:2]) for x in leaves}) != 1 or len(
            {int(x.shape[SEQ_AXIS]) for x in leaves}) != 1:
        return None
    for x in leaves:
        if id(x) not in out:
            out[id(x)] = scatter(x, devices)
    return out


def sequence_layers(layers: Sequence[Any], splits: Any, devices_of: Callable[[str], Any]
                    ) -> dict[str, tuple[str, ...]]:
    """{name: its stage's tp devices} of the unsplit per-token ``layers``."""
    return {layer.name: tuple(devices_of(layer.name)) for layer in layers
            if layer.name not in splits and token_wise(layer)}



def gathered_layers(layers: Sequence[Any], splits: Any) -> set[str]:
    """Names of the unsplit layers that are not per-token (``token_wise``): with sequence
    parallelism they read the whole sequence, gathered, on their stage's rank 0."""
    return {layer.name for layer in layers if layer.name not in splits
            and not isinstance(layer, keras.layers.InputLayer) and not token_wise(layer)}


def warn_gathered(plan_name: str, names: Collection[str]) -> None:
    """The note that ``names`` run gathered (a UserWarning; nothing is wrong, it costs)."""
    if names:
        warnings.warn(
            f"Plan {plan_name!r} runs sequence parallelism; layers {sorted(names)} are not "
            "per-token layers (they may mix positions: Flatten, pooling, convolutions, "
            "position embeddings, unsplit Dense, ...) so they run on the whole sequence, "
            "gathered on their stage's rank 0, as without it (apply.sequence_parallel). "
            "Split them in the plan, or accept the all-gather.", stacklevel=3)
