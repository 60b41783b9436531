"""One tensor-parallel rank's twin of a split Keras layer: its shard, on its own device.

Pipeline position: ``apply.spmd.copies`` puts ``rank_twin(layer, ...)`` where a plan's
``tp_splits`` names a layer, in each device's copy of the model; the twins call the
Megatron operators of ``apply.spmd.megatron`` (Shoeybi et al. 2019, Sec. 3). Every rank
runs the same layers on the same (replicated) input and ends with the same output, so
the layers around a split one run on every rank (Megatron's layout), never on one device
for the others. Rank t of a group of tp:

* ``column`` (Dense, EinsumDense): slice t of the kernel's output axis (and of the bias
  along it); f on the input. Its output stays sliced where the plan's next split layer is
  a ``row`` split that reads it (the MLP pair); otherwise the slices are all-gathered;
* ``row`` (Dense, EinsumDense): slice t of the kernel's contracted input axis; a whole
  input is cut to the rank's slice first; g on the partial product, then the whole bias
  and the activation;
* ``heads`` (MultiHeadAttention and subclasses that keep its computation, keras_hub's
  CachedMultiHeadAttention): heads [t h/tp, (t+1) h/tp) of Q, K, V and the output
  projection; f once per distinct input, g on the output projection, then its bias;
* ``vocab`` (Embedding): rows [t V/tp, (t+1) V/tp) of the table; ids outside them look
  up zeros; g on the lookup. Its mask (``mask_zero``) is computed from the whole ids.

``rank_axes()`` gives, for each of the twin's weights (in the unsplit layer's weight
order), the axis its unsplit array is cut along, or None for a whole (replicated) one;
``apply.spmd.copies`` reads and writes unsplit weights with it. Split dimensions must
divide by tp (``split_problem`` says which does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
from keras import ops

from tfplan import compat
from tfplan.apply.groups import Group
from tfplan.apply.spmd.megatron import (copy_to_tp, gather_from_tp, reduce_from_tp,
                                        scatter_to_tp)
from tfplan.apply.sequence_parallel import elementwise
from tfplan.apply.sharded_layers import is_cached_attention
from tfplan.core.errors import PlannerError
from tfplan.profiler.signature import layer_config


@dataclass(frozen=True)
class Rank:
    """Where a twin runs: its ``split``, the ``tp`` group, its ``device`` in it, and for a
    column split whether its output is gathered (``gather_output``)."""

    split: str
    group: Group
    device: str
    gather_output: bool = True

    @property
    def index(self) -> int:
        return self.group.devices.index(self.device)

    @property
    def size(self) -> int:
        return self.group.size


class _RankTwin:
    """What every twin shares: its ``Rank``; for a column or row split of a Dense-like
    layer (``kernel``, ``bias``, ``activation``), its call around a ``product`` and the
    whole bias a row split adds after g (``row_bias``)."""

    rank: Rank
    row_bias: Any = None

    def rank_axes(self) -> list[int | None]:
        raise NotImplementedError

    def _add_row_bias(self, shape: Any) -> None:
        self.row_bias = self.add_weight(name="bias", shape=tuple(shape),
                                        initializer=self.bias_initializer,
                                        regularizer=self.bias_regularizer,
                                        constraint=self.bias_constraint)

    def _split_call(self, inputs: Any, product: Any, sliced_in: int) -> Any:
        """Column: f, the rank's slice of the product (and bias), ``_column_out``. Row: a
        whole input cut to the rank's ``sliced_in`` features, g on the partial product,
        then the whole bias and the activation."""
        r = self.rank
        if r.split == "column":
            y = product(copy_to_tp(inputs, r.group, r.device))
            if self.bias is not None:
                y = ops.add(y, self.bias)
            return _column_out(self, y)
        x = inputs
        if x.shape[-1] == self.full_in and self.full_in != sliced_in:
            x = scatter_to_tp(x, r.group, r.device)
        y = reduce_from_tp(product(x), r.group, r.device)
        if self.row_bias is not None:
            y = ops.add(y, self.row_bias)
        return y if self.activation is None else self.activation(y)


class RankDense(_RankTwin, keras.layers.Dense):
    def __init__(self, rank: Rank, full_units: int, **config: Any) -> None:
        self.rank, self.full_units = rank, full_units
        self.full_use_bias = config.get("use_bias", True)
        config["units"] = full_units // rank.size if rank.split == "column" else full_units
        if rank.split == "row":
            config["use_bias"] = False  # the row split adds the whole bias after g
        super().__init__(**config)

    def build(self, input_shape: Any) -> None:
        self.full_in = int(input_shape[-1])
        if self.rank.split == "row":
            input_shape = (*input_shape[:-1], self.full_in // self.rank.size)
        super().build(input_shape)
        self.input_spec = None  # a row split reads a slice or the whole input
        if self.rank.split == "row" and self.full_use_bias:
            self._add_row_bias((self.full_units,))

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self._split_call(inputs, lambda x: ops.matmul(x, self.kernel),
                                self.kernel.shape[0])

    def compute_output_shape(self, input_shape: Any) -> Any:
        units = self.units if self.rank.split == "column" and not self.rank.gather_output \
            else self.full_units
        return (*input_shape[:-1], units)

    def rank_axes(self) -> list[int | None]:
        if self.rank.split == "column":
            return [1, 0] if self.use_bias else [1]
        return [0, None] if self.row_bias is not None else [0]


def _column_out(layer: Any, y: Any) -> Any:
    """A column split's output: its activation, and the all-gather unless a row split
    reads the slice (an activation that is not elementwise runs on the gathered whole)."""
    r, act = layer.rank, layer.activation
    if elementwise(act):
        y = y if act is None else act(y)
        return gather_from_tp(y, r.group, r.device) if r.gather_output else y
    if not r.gather_output:
        raise PlannerError(f"Layer {layer.name!r} is split by column with a "
                           f"{getattr(act, '__name__', act)} activation, which mixes the "
                           "units, so its output cannot stay sliced for the row split after "
                           "it. Leave it (or that row split) replicated.")
    return act(gather_from_tp(y, r.group, r.device))


class RankEinsumDense(_RankTwin, keras.layers.EinsumDense):
    def __init__(self, rank: Rank, **config: Any) -> None:
        self.rank = rank
        inp, rest = config["equation"].split(",")
        ker, out = rest.split("->")
        self._specs = (inp, ker, out)
        self.full_bias_axes = config.get("bias_axes")
        if rank.split == "column":
            shape = config["output_shape"]
            shape = list(shape) if isinstance(shape, (list, tuple)) else [shape]
            if shape[-1] is not None:
                if shape[-1] % rank.size:
                    raise PlannerError(f"EinsumDense {config.get('name')!r}: its output's "
                                       f"last axis ({shape[-1]}) does not divide by "
                                       f"tp={rank.size}.")
                shape[-1] //= rank.size
            config["output_shape"] = shape
        else:
            config["bias_axes"] = None  # the row split adds the whole bias after g
        super().__init__(**config)

    def build(self, input_shape: Any) -> None:
        inp, ker, out = self._specs
        self.full_in = int(input_shape[-1])
        self.kernel_axis = ker.index(out[-1] if self.rank.split == "column" else inp[-1])
        if self.rank.split == "row":
            _, bias_shape, _ = compat.analyze_einsum_string(
                self.equation, self.full_bias_axes, input_shape, self.partial_output_shape)
            input_shape = (*input_shape[:-1], self.full_in // self.rank.size)
        super().build(input_shape)
        self.input_spec = None
        if self.rank.split == "row" and self.full_bias_axes:
            self._add_row_bias(bias_shape)

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self._split_call(inputs, lambda x: ops.einsum(self.equation, x, self.kernel),
                                self.kernel.shape[self.kernel_axis])

    def rank_axes(self) -> list[int | None]:
        if self.rank.split == "column":
            axes: list[int | None] = [self.kernel_axis]
            if self.bias is not None:
                sliced = self._specs[2][-1] in (self.bias_axes or "")
                axes.append(len(self.bias.shape) - 1 if sliced else None)
            return axes
        return [self.kernel_axis] + ([None] if self.row_bias is not None else [])


class RankEmbedding(_RankTwin, keras.layers.Embedding):
    def __init__(self, rank: Rank, full_input_dim: int, **config: Any) -> None:
        self.rank, self.full_input_dim = rank, full_input_dim
        config["input_dim"] = full_input_dim // rank.size
        super().__init__(**config)

    def call(self, inputs: Any) -> Any:
        r = self.rank
        if inputs.dtype not in ("int32", "int64"):
            inputs = ops.cast(inputs, "int32")
        lo = r.index * self.input_dim
        local = inputs - ops.cast(lo, inputs.dtype)
        inside = ops.logical_and(local >= 0, local < self.input_dim)
        rows = ops.take(self.embeddings, ops.where(inside, local, ops.zeros_like(local)), axis=0)
        rows = ops.where(ops.expand_dims(inside, -1), rows, ops.zeros_like(rows))
        return reduce_from_tp(rows, r.group, r.device)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return None if not self.mask_zero else ops.not_equal(inputs, 0)

    def rank_axes(self) -> list[int | None]:
        return [0]


class RankMultiHeadAttention(_RankTwin, keras.layers.MultiHeadAttention):
    """Heads [t h/tp, (t+1) h/tp); keras_hub's CachedMultiHeadAttention's training call
    (no cache) is this computation too."""

    def __init__(self, rank: Rank, full_heads: int, **config: Any) -> None:
        self.rank, self.full_heads = rank, full_heads
        config["num_heads"] = full_heads // rank.size
        super().__init__(**config)

    def call(self, query: Any, value: Any, key: Any = None, query_mask: Any = None,
             value_mask: Any = None, key_mask: Any = None, attention_mask: Any = None,
             return_attention_scores: bool = False, training: Any = None,
             use_causal_mask: bool = False, cache: Any = None,
             cache_update_index: Any = None) -> Any:
        r = self.rank
        if cache is not None:
            raise PlannerError(f"Attention layer {self.name!r} is split by heads for "
                               "training; a key/value cache (generation) is not supported "
                               "on the split layer. Generate with the unsplit model.")
        key = value if key is None else key
        query_mask = compat.get_keras_mask(query)  # as MultiHeadAttention.call reads them
        value_mask = compat.get_keras_mask(value) if value_mask is None else value_mask
        key_mask = compat.get_keras_mask(key) if key_mask is None else key_mask
        for x in (query, value, key):  # and clears them, so a residual `x + attention(x)`
            compat.set_keras_mask(x, None)  # of Add layers drops the mask as on one device
        attention_mask = compat.attention_mask(
            self, query, value, query_mask=query_mask, value_mask=value_mask,
            key_mask=key_mask, attention_mask=attention_mask, use_causal_mask=use_causal_mask)
        copied: dict[int, Any] = {}  # f once per distinct input (self-attention: once)

        def f(x: Any) -> Any:
            if id(x) not in copied:
                copied[id(x)] = copy_to_tp(x, r.group, r.device)
            return copied[id(x)]

        q = self.query_dense(f(query))
        k = self.key_dense(f(key))
        v = self.value_dense(f(value))
        out, scores = compat.attention_scores(self, q, k, v, attention_mask, training,
                                              return_attention_scores)
        dense = self.output_dense
        y = reduce_from_tp(ops.einsum(dense.equation, out, dense.kernel), r.group, r.device)
        if dense.bias is not None:
            y = ops.add(y, dense.bias)
        if query_mask is not None:
            compat.set_keras_mask(y, query_mask)
        return (y, scores) if return_attention_scores else y

    def rank_axes(self) -> list[int | None]:
        bias = self.output_dense.bias is not None
        per_projection = [1, 0] if bias else [1]
        out = [0, None] if bias else [0]
        return per_projection * 3 + out


def split_problem(layer: Any, split: str, tp: int) -> str:
    """Why ``layer`` cannot be split by ``split`` over ``tp`` ranks here ("" when it can)."""
    cls = type(layer)
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized layers are not split"
    if split == "heads":
        if cls is not keras.layers.MultiHeadAttention and not is_cached_attention(layer):
            return f"{cls.__name__} is not MultiHeadAttention (split by heads here)"
        settings = compat.attention_settings(layer)
        if settings.use_gate or layer.attention_axes not in (None, (1,), [1]):
            return "gated attention or custom attention_axes"
        return "" if layer.num_heads % tp == 0 else f"its {layer.num_heads} heads"
    if split == "vocab":
        if cls is not keras.layers.Embedding:
            return f"{cls.__name__} is not an Embedding"
        return "" if layer.input_dim % tp == 0 else f"its vocabulary of {layer.input_dim}"
    if cls is keras.layers.Dense:
        n = layer.units if split == "column" else int(layer.kernel.shape[0])
        return "" if n % tp == 0 else f"its {'units' if split == 'column' else 'inputs'} ({n})"
    if cls is keras.layers.EinsumDense:
        inp, rest = layer.equation.split(",")
        ker, out = rest.split("->")
        char = out[-1] if split == "column" else inp[-1]
        if "." in layer.equation or char not in ker or (
                char in inp if split == "column" else char in out):
            return f"equation {layer.equation!r} cannot be cut by {split}"
        # the kernel's output (column) or contracted (row) axes: with several, as attention
        # projections' heads x head_dim ("bqm,muh->bquh"), the last is within each head,
        # which per-head ops (rotary embeddings, norms) read whole
        kernel_axes = [c for c in ker if (c in out if split == "column" else c in inp)]
        if len(kernel_axes) > 1:
            return (f"equation {layer.equation!r} has {len(kernel_axes)} "
                    f"{'output' if split == 'column' else 'contracted'} kernel axes")
        n = int(layer.kernel.shape[ker.index(char)])
        return "" if n % tp == 0 else f"its split axis ({n})"
    return f"{cls.__name__} layers are not split by {split!r} here"


def rank_twin(layer: Any, rank: Rank) -> Any:
    """The rank's twin of ``layer`` (unbuilt), from the unsplit layer's config."""
    config = layer_config(layer)
    if rank.split == "heads":
        config.pop("num_heads", None)
        return RankMultiHeadAttention(rank, layer.num_heads, **config)
    if rank.split == "vocab":
        config.pop("input_dim", None)
        return RankEmbedding(rank, layer.input_dim, **config)
    if isinstance(layer, keras.layers.EinsumDense):
        return RankEinsumDense(rank, **config)
    config.pop("units", None)
    return RankDense(rank, layer.units, **config)


def is_twin(layer: Any) -> bool:
    return isinstance(layer, _RankTwin)


__all__ = ["Rank", "RankDense", "RankEinsumDense", "RankEmbedding", "RankMultiHeadAttention",
           "is_twin", "rank_twin", "split_problem"]
