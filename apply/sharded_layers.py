"""Sharded twins of Keras layers, each shard's variables and ops on its tensor-parallel device.

Pipeline position: ``apply.tensor_parallel`` re-creates each layer a plan's
``tp_splits`` names with ``sharded_clone`` (same config and name, a split and the
tp devices of its stage) when it clones the user's model. Layout (Megatron-LM,
Shoeybi et al. 2019, Sec. 3), shard t on ``tf.device`` of rank t, its variables
built there (DESIGN.md: Keras 3 creates variables where the layer is built); the
"layer's device" below is the device the layer itself is called under (rank 0 of
its stage, ``apply.tensor_parallel``):

* ``column`` (Dense, EinsumDense, Conv1D/2D/3D): the kernel's output axis (a
  convolution's filters) is cut in tp slices; each rank computes its slice of the
  output (bias and an elementwise activation included), and the slices are
  concatenated on the layer's device;
* ``row`` (Dense, EinsumDense, Conv1D/2D/3D): the kernel's input axis (a
  convolution's input channels) is cut; each rank
  multiplies its slice of the input, and the partial outputs are summed
  (``tf.add_n``) on the layer's device, where the bias and activation follow. A
  row layer that reads a column layer's concatenation takes the column shards
  straight from their ranks (the Megatron column -> row pair moves no activation
  between ranks; the concatenation is then unused and pruned by TensorFlow);
* ``heads`` (MultiHeadAttention, ``apply.sharded_attention``): rank t holds its heads' Q, K, V and output
  projections and computes their attention (Keras' own ``_compute_attention``);
  the partial outputs are summed on the layer's device, where the output bias is;
  GroupQueryAttention the same, rank t holding num_query_heads/tp query heads and
  the num_key_value_heads/tp key/value heads they share (tp must divide
  num_key_value_heads);
* ``vocab`` (Embedding): rank t holds a slice of the vocabulary's rows, looks up
  the ids that fall in it (the others read row 0 masked to zero), and the
  lookups are summed on the layer's device.

With sequence parallelism (``sequence_parallel``, ``apply.sequence_parallel``) a
column or heads layer first all-gathers a sequence-sharded input on each rank, and a
row, heads or vocab layer reduce-scatters its partial sums into sequence pieces
[batch, seq/tp, out], rank t adding the bias (and activation) to its own piece.

Shards are nearly equal (``shard_sizes``: the first ones one larger). Every sharded
layer reads and writes its weights unsplit: ``get_weights``/``set_weights``, weight
files and saved models have the unsplit layer's arrays, layout, class name and
config. A split attention layer with dropout draws its masks per shard, so its
random masks differ from the unsplit layer's (losses match without dropout).

Convolutions are split the same way because a convolution is a matrix product over
channels at every spatial position: cutting the filters cuts the output channels
(column), cutting the input channels leaves partial sums of the whole output (row;
Megatron-LM's f/g apply unchanged, with the convolution's activations). Strides,
padding (Conv1D's "causal" too) and dilation act on the spatial axes only, so every
shard uses the layer's own.

Not split yet (a PlannerError says so): convolutions with ``groups`` > 1, channels
first data or LoRA enabled; attention with a gate, inputs of rank other
than 3, custom attention axes or a multi-axis output; grouped-query attention with
dropout; EinsumDense equations with
``...`` or whose cut axis is not a kernel-only output axis (column) or a contracted
input axis (row); subclasses of these layers (their ``call`` may differ), but keras_hub's
CachedMultiHeadAttention, split by heads (``apply.sharded_attention``). A split sub-layer
of a block is swapped into the block in place (``apply.blocks``); a custom attention block
split by heads whole runs its own call per rank (``apply.sharded_attention_block``).
"""
from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfplan import compat
from tfplan.apply.sequence_parallel import (ELEMENTWISE, Gathered, elementwise,  # noqa: F401
                                            shard_sizes)
from tfplan.apply.sharded_attention import (CACHED_ATTENTION, ShardedCachedMultiHeadAttention,
                                            ShardedGroupQueryAttention,
                                            ShardedMultiHeadAttention)
from tfplan.apply.sharded_base import Sharded, assign_pieces, concat_variables, row_output
from tfplan.core.errors import PlannerError

_Sharded = Sharded  # the base's former name here (tests check isinstance with it)

SPLITTABLE = {"column": "Dense, EinsumDense, Conv1D, Conv2D, Conv3D",
              "row": "Dense, EinsumDense, Conv1D, Conv2D, Conv3D",
              "heads": "MultiHeadAttention, GroupQueryAttention, keras_hub's "
                       "CachedMultiHeadAttention", "vocab": "Embedding"}


def is_cached_attention(layer: Any) -> bool:
    """Whether ``layer`` is keras_hub's CachedMultiHeadAttention (split by heads as
    ``apply.sharded_attention.ShardedCachedMultiHeadAttention``)."""
    cls = type(layer)
    return ((cls.__module__, cls.__name__) == CACHED_ATTENTION
            and isinstance(layer, keras.layers.MultiHeadAttention)
            and not isinstance(layer, Sharded))


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    ends = np.cumsum([0, *sizes])
    return [(int(ends[t]), int(ends[t + 1])) for t in range(len(sizes))]


def _column_or_row(layer: Any, inputs: Any, product: Any) -> Any:
    """A column or row split Dense/Conv forward: ``product(x, kernel)`` on each rank.

    Column: rank t computes its output slice (bias and an elementwise activation too),
    concatenated on the last axis. Row: rank t multiplies its input slice, the partial
    products are summed (``tf.add_n``), then the bias and activation follow. With
    sequence parallelism a column layer first gathers a sequence-sharded input on each
    rank, and a row layer reduce-scatters its partial sums into sequence pieces, each
    rank adding the bias and activation to its own (``apply.sequence_parallel``)."""
    shard_act = elementwise(layer.activation)
    if layer.tp_split == "column":
        outs, whole = [], Gathered(layer.tp_devices)
        for t, d in enumerate(layer.tp_devices):
            with tf.device(d):
                y = product(whole(inputs, t), layer.kernels[t])
                if layer.biases:
                    y = ops.add(y, layer.biases[t])
                if shard_act and layer.activation is not None:
                    y = layer.activation(y)
                outs.append(y)
        y = tf.concat(outs, axis=-1)
        return y if shard_act or layer.activation is None else layer.activation(y)
    parts = _input_shards(inputs, layer.sizes, layer.tp_devices)
    partial = []
    for t, d in enumerate(layer.tp_devices):
        with tf.device(d):
            partial.append(product(parts[t], layer.kernels[t]))
    return row_output(layer, partial, layer.biases[0] if layer.biases else None,
                       layer.activation)


def _input_shards(x: Any, sizes: Sequence[int], devices: Sequence[str]) -> list[Any]:
    """``x`` cut along its last axis in ``sizes``, slice t on devices[t].

    When ``x`` is a concatenation along the last axis of pieces of exactly these sizes
    (a column layer's output), the pieces themselves are returned: they already sit on
    their ranks.
    """
    op = getattr(x, "op", None) if not tf.executing_eagerly() else None
    if op is not None and op.type == "ConcatV2" and len(op.inputs) == len(sizes) + 1:
        axis = tf.get_static_value(op.inputs[-1])
        pieces = list(op.inputs[:-1])
        rank = x.shape.rank
        if axis is not None and rank is not None and int(axis) in (-1, rank - 1) and all(
                p.shape[-1] == s for p, s in zip(pieces, sizes)):
            return pieces
    out = []
    for (lo, hi), d in zip(_bounds(sizes), devices):
        with tf.device(d):
            out.append(x[..., lo:hi])
    return out


class ShardedDense(Sharded, keras.layers.Dense):
    """A Dense layer split by column (output units) or row (input features)."""

    def __init__(self, units: int, *, tp_split: str = "column",
                 tp_devices: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(units, **kwargs)
        self._init_tp(tp_split, tp_devices)

    def build(self, input_shape: Any) -> None:
        in_dim, tp = int(input_shape[-1]), len(self.tp_devices)
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_dim})
        if self.tp_split == "column":
            self.sizes = shard_sizes(self.units, tp)
            self.kernels = self._add_shards("kernel", [(in_dim, s) for s in self.sizes],
                                            self.kernel_initializer, self.kernel_regularizer,
                                            self.kernel_constraint)
            self.biases = self._add_shards("bias", [(s,) for s in self.sizes],
                                           self.bias_initializer, self.bias_regularizer,
                                           self.bias_constraint) if self.use_bias else []
        else:
            self.sizes = shard_sizes(in_dim, tp)
            self.kernels = self._add_shards("kernel", [(s, self.units) for s in self.sizes],
                                            self.kernel_initializer, self.kernel_regularizer,
                                            self.kernel_constraint)
            self.biases = [self.add_weight(
                name="bias", shape=(self.units,), initializer=self.bias_initializer,
                regularizer=self.bias_regularizer, constraint=self.bias_constraint)
            ] if self.use_bias else []
        compat.drop_unsplit_kernel(self)  # the unsplit ones do not exist
        self.bias = None
        self.built = True

    def call(self, inputs: Any, training: Any = None) -> Any:
        return _column_or_row(self, inputs, ops.matmul)

    def full_weights(self) -> list[np.ndarray]:
        axis = 1 if self.tp_split == "column" else 0
        out = [concat_variables(self.kernels, axis)]
        if self.biases:
            out.append(concat_variables(self.biases, 0) if self.tp_split == "column"
                       else self.biases[0].numpy())
        return out

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        column = self.tp_split == "column"
        out: list[tuple[tuple[Any, ...], int | None]] = [(tuple(self.kernels),
                                                          1 if column else 0)]
        if self.biases:
            out.append((tuple(self.biases), 0) if column else ((self.biases[0],), None))
        return out

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        assign_pieces(self.kernels, weights[0], 1 if self.tp_split == "column" else 0)
        if self.biases:
            if self.tp_split == "column":
                assign_pieces(self.biases, weights[1], 0)
            else:
                self.biases[0].assign(weights[1])


class ShardedEinsumDense(Sharded, keras.layers.EinsumDense):
    """An EinsumDense split along the kernel axis of the output's last axis (column) or
    of the input's last axis, when that axis is contracted (row)."""

    def __init__(self, equation: str, output_shape: Any, *, tp_split: str = "column",
                 tp_devices: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(equation, output_shape, **kwargs)
        self._init_tp(tp_split, tp_devices)
        inp, rest = equation.split(",")
        ker, out = rest.split("->")
        self._specs = (inp, ker, out)

    def split_axis(self) -> int:
        """The kernel axis this split cuts; PlannerError when the equation cannot be cut."""
        inp, ker, out = self._specs
        char = out[-1] if self.tp_split == "column" else inp[-1]
        ok = "." not in self.equation and char in ker and (
            char not in inp if self.tp_split == "column" else char not in out)
        if not ok:
            raise PlannerError(
                f"EinsumDense layer {self.name!r} (equation {self.equation!r}) cannot be split "
                f"by {self.tp_split!r}: a column split needs the output's last axis to come "
                "from the kernel alone, a row split needs the input's last axis contracted "
                "with the kernel, and neither may use '...'. Re-plan with that layer "
                "replicated (remove it from tp_splits).")
        return ker.index(char)

    def build(self, input_shape: Any) -> None:
        kernel_shape, bias_shape, full_output_shape = compat.analyze_einsum_string(
            self.equation, self.bias_axes, input_shape, self.partial_output_shape)
        self.full_output_shape = tuple(full_output_shape)
        self.input_spec = keras.layers.InputSpec(ndim=len(input_shape))
        axis = self.kernel_axis = self.split_axis()
        self.sizes = shard_sizes(int(kernel_shape[axis]), len(self.tp_devices))
        shapes = [tuple(s if i == axis else int(n) for i, n in enumerate(kernel_shape))
                  for s in self.sizes]
        self.kernels = self._add_shards("kernel", shapes, self.kernel_initializer,
                                        self.kernel_regularizer, self.kernel_constraint)
        # a column split's bias is cut too when it spans the output's last axis
        self.bias_sharded = bool(bias_shape is not None and self.tp_split == "column"
                                 and self._specs[2][-1] in (self.bias_axes or ""))
        if bias_shape is None:
            self.biases = []
        elif self.bias_sharded:
            self.biases = self._add_shards(
                "bias", [(*bias_shape[:-1], s) for s in self.sizes], self.bias_initializer,
                self.bias_regularizer, self.bias_constraint)
        else:
            self.biases = [self.add_weight(
                name="bias", shape=tuple(bias_shape), initializer=self.bias_initializer,
                regularizer=self.bias_regularizer, constraint=self.bias_constraint)]
        compat.drop_unsplit_kernel(self)
        self.bias = None
        self.built = True

    def call(self, inputs: Any, training: Any = None) -> Any:
        shard_act = elementwise(self.activation) and (self.bias_sharded or not self.biases)
        if self.tp_split == "column":
            outs, whole = [], Gathered(self.tp_devices)
            for t, d in enumerate(self.tp_devices):
                with tf.device(d):
                    y = ops.einsum(self.equation, whole(inputs, t), self.kernels[t])
                    if self.bias_sharded:
                        y = ops.add(y, self.biases[t])
                    if shard_act and self.activation is not None:
                        y = self.activation(y)
                    outs.append(y)
            y = tf.concat(outs, axis=-1)
            if shard_act:
                return y
        else:
            parts = _input_shards(inputs, self.sizes, self.tp_devices)
            partial = []
            for t, d in enumerate(self.tp_devices):
                with tf.device(d):
                    partial.append(ops.einsum(self.equation, parts[t], self.kernels[t]))
            inp, _, out = self._specs
            # sequence pieces only when the output keeps the input's [batch, seq] axes
            # and the bias does not vary along seq
            per_token = len(out) == 3 and inp[:2] == out[:2] and out[1] not in (
                self.bias_axes or "")
            return row_output(self, partial, self.biases[0] if self.biases else None,
                               self.activation, per_token=per_token)
        if self.biases and not self.bias_sharded:
            y = ops.add(y, self.biases[0])
        return y if self.activation is None else self.activation(y)

    def full_weights(self) -> list[np.ndarray]:
        out = [concat_variables(self.kernels, self.kernel_axis)]
        if self.biases:
            out.append(concat_variables(self.biases, -1) if self.bias_sharded else self.biases[0].numpy())
        return out

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        out: list[tuple[tuple[Any, ...], int | None]] = [
            (tuple(self.kernels), self.kernel_axis % len(self.kernels[0].shape))]
        if self.biases:
            out.append((tuple(self.biases), len(self.biases[0].shape) - 1)
                       if self.bias_sharded else ((self.biases[0],), None))
        return out

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        assign_pieces(self.kernels, weights[0], self.kernel_axis)
        if self.biases:
            if self.bias_sharded:
                assign_pieces(self.biases, weights[1], len(self.biases[0].shape) - 1)
            else:
                self.biases[0].assign(weights[1])


class _ShardedConv(Sharded):
    """A Keras convolution (Conv1D/2D/3D, channels last) split by column (filters) or row
    (input channels); mixed into a subclass of the Keras class, whose config it keeps."""

    rank: int

    def _check_splittable(self) -> None:
        problems = []
        if self.groups != 1:
            problems.append(f"groups={self.groups} (grouped convolutions)")
        if self.data_format != "channels_last":
            problems.append(f"data_format={self.data_format!r}")
        if self.lora_rank:
            problems.append(f"lora_rank={self.lora_rank}")
        if problems:
            raise PlannerError(
                f"{type(self).__name__} layer {self.name!r} cannot be split by "
                f"{self.tp_split!r}: it has {', '.join(problems)}; apply splits convolutions "
                "with groups=1, data_format='channels_last' and no LoRA. Re-plan with that "
                "layer replicated (remove it from tp_splits).")

    def build(self, input_shape: Any) -> None:
        self._check_splittable()
        in_ch, tp = int(input_shape[-1]), len(self.tp_devices)
        self.input_spec = keras.layers.InputSpec(min_ndim=self.rank + 2, axes={-1: in_ch})
        self.compute_output_shape(input_shape)  # Keras' own checks of the spatial sizes
        ks = tuple(self.kernel_size)
        kw = dict(initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
                  constraint=self.kernel_constraint)
        bw = dict(initializer=self.bias_initializer, regularizer=self.bias_regularizer,
                  constraint=self.bias_constraint)
        if self.tp_split == "column":
            self.sizes = shard_sizes(self.filters, tp)
            self.kernels = self._add_shards("kernel", [(*ks, in_ch, s) for s in self.sizes],
                                            **kw)
            self.biases = self._add_shards("bias", [(s,) for s in self.sizes],
                                           **bw) if self.use_bias else []
        else:
            self.sizes = shard_sizes(in_ch, tp)
            self.kernels = self._add_shards("kernel", [(*ks, s, self.filters)
                                                       for s in self.sizes], **kw)
            self.biases = [self.add_weight(name="bias", shape=(self.filters,), **bw)
                           ] if self.use_bias else []
        compat.drop_unsplit_kernel(self)  # the unsplit ones do not exist
        self.bias = None
        self.built = True

    def _conv(self, x: Any, kernel: Any) -> Any:
        padding = self.padding
        if padding == "causal":  # as keras.layers.Conv1D.call
            x = ops.pad(x, compat.conv_causal_padding(self))
            padding = "valid"
        return ops.conv(x, kernel, strides=list(self.strides), padding=padding,
                        dilation_rate=self.dilation_rate, data_format=self.data_format)

    def call(self, inputs: Any) -> Any:
        return _column_or_row(self, inputs, self._conv)  # channels last: biases broadcast

    def full_weights(self) -> list[np.ndarray]:
        column = self.tp_split == "column"
        out = [concat_variables(self.kernels, -1 if column else -2)]
        if self.biases:
            out.append(concat_variables(self.biases, 0) if column else self.biases[0].numpy())
        return out

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        column = self.tp_split == "column"
        out: list[tuple[tuple[Any, ...], int | None]] = [
            (tuple(self.kernels), self.rank + (1 if column else 0))]
        if self.biases:
            out.append((tuple(self.biases), 0) if column else ((self.biases[0],), None))
        return out

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        column = self.tp_split == "column"
        assign_pieces(self.kernels, weights[0], self.rank + (1 if column else 0))
        if self.biases:
            if column:
                assign_pieces(self.biases, weights[1], 0)
            else:
                self.biases[0].assign(weights[1])


def _conv_class(base: Any) -> Any:
    """The sharded twin of one Keras convolution class (its __init__ takes filters,
    kernel_size and the config's other keywords)."""

    class ShardedConv(_ShardedConv, base):
        def __init__(self, filters: int, kernel_size: Any, *, tp_split: str = "column",
                     tp_devices: Sequence[str] = (), **kwargs: Any) -> None:
            super().__init__(filters, kernel_size, **kwargs)
            self._init_tp(tp_split, tp_devices)

    ShardedConv.__qualname__ = f"Sharded{base.__name__}"
    return ShardedConv


ShardedConv1D = _conv_class(keras.layers.Conv1D)
ShardedConv2D = _conv_class(keras.layers.Conv2D)
ShardedConv3D = _conv_class(keras.layers.Conv3D)


class ShardedEmbedding(Sharded, keras.layers.Embedding):
    """An Embedding split over the vocabulary: rank t holds rows [lo_t, hi_t)."""

    def __init__(self, input_dim: int, output_dim: int, *, tp_split: str = "vocab",
                 tp_devices: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(input_dim, output_dim, **kwargs)
        self._init_tp(tp_split, tp_devices)

    def build(self, input_shape: Any = None) -> None:
        self.sizes = shard_sizes(self.input_dim, len(self.tp_devices))
        self.tables = self._add_shards("embeddings", [(s, self.output_dim) for s in self.sizes],
                                       self.embeddings_initializer,
                                       self.embeddings_regularizer, self.embeddings_constraint)
        compat.drop_unsplit_embeddings(self)
        self.built = True

    def call(self, inputs: Any) -> Any:
        if inputs.dtype != "int32" and inputs.dtype != "int64":
            inputs = ops.cast(inputs, "int32")
        parts = []
        for (lo, hi), table, d in zip(_bounds(self.sizes), self.tables, self.tp_devices):
            with tf.device(d):
                inside = tf.logical_and(inputs >= lo, inputs < hi)
                local = tf.where(inside, inputs - lo, tf.zeros_like(inputs))
                rows = tf.gather(table, local)
                parts.append(rows * tf.cast(inside, rows.dtype)[..., None])
        # summed on the layer's device (reduce-scattered with sequence parallelism), then cast
        return row_output(self, parts, None,
                           lambda y: ops.cast(y, dtype=self.compute_dtype))

    def full_weights(self) -> list[np.ndarray]:
        return [concat_variables(self.tables, 0)]

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        return [(tuple(self.tables), 0)]

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        assign_pieces(self.tables, weights[0], 0)


# Keras names a weight file's entries after each layer's class (``dense``, ``dense_1``,
# ...) and a saved model's layers by class and module: the sharded classes carry the
# unsplit class's name and module and its config (no tp fields), so with their unsplit
# ``save_own_variables`` a wrapped model's weight file is the user's model's, and
# ``keras.models.load_model`` reads a saved one back as unsplit Keras layers.
for _cls, _base in ((ShardedDense, keras.layers.Dense),
                    (ShardedEinsumDense, keras.layers.EinsumDense),
                    (ShardedEmbedding, keras.layers.Embedding),
                    (ShardedMultiHeadAttention, keras.layers.MultiHeadAttention),
                    (ShardedGroupQueryAttention, keras.layers.GroupQueryAttention),
                    (ShardedConv1D, keras.layers.Conv1D), (ShardedConv2D, keras.layers.Conv2D),
                    (ShardedConv3D, keras.layers.Conv3D)):
    _cls.__name__, _cls.__module__ = _base.__name__, _base.__module__

SHARDED = {("Dense", "column"): ShardedDense, ("Dense", "row"): ShardedDense,
           ("EinsumDense", "column"): ShardedEinsumDense,
           ("EinsumDense", "row"): ShardedEinsumDense,
           ("Embedding", "vocab"): ShardedEmbedding,
           ("MultiHeadAttention", "heads"): ShardedMultiHeadAttention,
           ("GroupedQueryAttention", "heads"): ShardedGroupQueryAttention,
           **{(cls.__name__, split): cls for cls in (ShardedConv1D, ShardedConv2D, ShardedConv3D)
              for split in ("column", "row")}}


# the public Keras class of each kind (GroupQueryAttention's class is GroupedQueryAttention)
_PUBLIC = {**{kind: getattr(keras.layers, kind) for kind, _ in SHARDED
              if hasattr(keras.layers, kind)},
           "GroupedQueryAttention": keras.layers.GroupQueryAttention}


def sharded_clone(layer: Any, split: str, devices: Sequence[str], plan_name: str = "", *,
                  sequence_parallel: bool = False) -> Any:
    """A sharded twin of ``layer`` (same config and name), not built yet; with
    ``sequence_parallel`` it gathers sequence-sharded inputs and reduce-scatters partial
    sums (``apply.sequence_parallel``)."""
    kind = type(layer).__name__
    cls = SHARDED.get((kind, split))
    tp = len(devices)
    if split == "heads" and is_cached_attention(layer):  # keras_hub's, same weights
        cls = ShardedCachedMultiHeadAttention
    elif cls is None or type(layer) is not _PUBLIC.get(kind):
        subclass = "" if cls is None else (
            f", a subclass of {_PUBLIC[kind].__name__} whose call may differ" if kind in
            _PUBLIC else ", not Keras' own class of that name")
        raise PlannerError(
            f"Plan {plan_name!r} splits layer {layer.name!r} ({kind}{subclass}) by "
            f"{split!r}; apply splits {split!r} only for "
            f"{SPLITTABLE.get(split, 'no layer type')} layers "
            "(column/row: Dense, EinsumDense, Conv1D, Conv2D, Conv3D; heads: "
            "MultiHeadAttention, GroupQueryAttention and keras_hub's "
            "CachedMultiHeadAttention; vocab: Embedding; Keras' own classes, not "
            "subclasses). Re-plan, or edit the plan's tp_splits to leave that layer "
            "replicated.")
    if cls is ShardedGroupQueryAttention and layer.num_key_value_heads % tp:
        fits = [d for d in range(1, layer.num_key_value_heads + 1)
                if layer.num_key_value_heads % d == 0]
        raise PlannerError(
            f"Plan {plan_name!r} splits grouped-query attention layer {layer.name!r} "
            f"({layer.num_query_heads} query heads, {layer.num_key_value_heads} key/value "
            f"heads) by heads over tp = {tp} devices; each device must hold whole key/value "
            f"heads with the query heads that read them, so tp must divide "
            f"num_key_value_heads = {layer.num_key_value_heads}. Re-plan with tp in {fits}, "
            "or leave that layer replicated (remove it from tp_splits).")
    heads = getattr(layer, "num_heads", None) or getattr(layer, "num_query_heads", 0)
    if split == "heads" and tp > heads:
        raise PlannerError(
            f"Plan {plan_name!r} splits attention layer {layer.name!r} ({heads} "
            f"heads) over tp = {tp} devices; each device needs at least one head. "
            "Re-plan with a smaller tp.")
    config = layer.get_config()
    config.update(tp_split=split, tp_devices=list(devices))
    clone = cls.from_config(config)
    clone.sequence_parallel = bool(sequence_parallel)
    return clone
