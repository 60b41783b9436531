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
from tfplan.apply.spmd.context import context_mask
from tfplan.apply.spmd.megatron import (all_gather_sequence, copy_to_tp, gather_from_sequence,
                                        gather_from_tp, gather_heads_from_tp,
                                        gather_sequence_to_tp, reduce_from_tp,
                                        reduce_scatter_from_tp, scatter_to_tp, slice_sizes)
from tfplan.apply.sequence_parallel import elementwise
from tfplan.core.errors import PlannerError
from tfplan.profiler.signature import layer_config
from tfplan.profiler.split_rules import (einsum_specs, einsum_split_axis, is_cached_attention,
                                        split_refusal)


@dataclass(frozen=True)
class Rank:
    """Where a twin runs: its ``split``, the ``tp`` group, its ``device`` in it, for a
    column split whether its output is gathered (``gather_output``), and whether the plan
    runs sequence parallelism (``sequence``: the module docstring's f-bar and g-bar)."""

    split: str
    group: Group
    device: str
    gather_output: bool = True
    sequence: bool = False
    # context parallelism: attention split by heads all-gathers its keys and values over
    # this group (``apply.spmd.context``)
    cp_group: Group | None = None

    @property
    def index(self) -> int:
        return self.group.devices.index(self.device)

    @property
    def size(self) -> int:
        return self.group.size


class _RankTwin:
    """What every twin shares: its ``Rank``; for a column or row split of a Dense-like
    layer (``kernel``, ``bias``, ``activation``), its call around a ``product`` and the
    whole bias a row split adds after g (``row_bias``). ``seq``: under sequence
    parallelism the whole sequence length of its (first) input, None without it or where
    the input has no sequence axis (axis 1 of a tensor of rank >= ``_SEQ_MIN_RANK``)."""

    tp_rank: Rank
    row_bias: Any = None
    seq: int | None = None
    _SEQ_MIN_RANK = 3

    def rank_axes(self) -> list[int | None]:
        raise NotImplementedError

    def _sequence_of(self, shape: Any) -> int | None:
        """The sequence length this twin cuts under sequence parallelism (None: it cuts
        none), from an input's build shape (the whole model's: under context parallelism
        the copy runs its 1/cp chunk of it); it must divide by tp."""
        shape = tuple(shape)
        if not self.tp_rank.sequence or len(shape) < self._SEQ_MIN_RANK or shape[1] is None:
            return None
        seq = int(shape[1])
        if self.tp_rank.cp_group is not None:
            seq //= self.tp_rank.cp_group.size
        if seq % self.tp_rank.size:
            raise PlannerError(
                f"Layer {self.name!r} runs under sequence parallelism, which cuts its "
                f"sequence of {seq} into tp={self.tp_rank.size} equal pieces; it does not "
                "divide. Use a sequence length that divides by tp, or set the plan's "
                "sequence_parallel to false.")
        return seq

    def piece_weights(self) -> list[Any]:
        """The weights this twin reads on sequence pieces: the whole bias added after
        g-bar (``apply.spmd.layout`` sums their gradients over tp)."""
        bias = self.row_bias if self.tp_rank.split == "row" else None
        if self.tp_rank.split == "heads":
            bias = compat.attention_projection(self, "output").bias
        return [bias] if self.seq and bias is not None else []

    def _enter(self, x: Any, seq: int | None) -> Any:
        """f, or under sequence parallelism f-bar where ``x`` is a piece of a sequence of
        ``seq`` (a whole input, e.g. the output of a layer that mixes positions, gets f)."""
        r = self.tp_rank
        if seq and _is_piece(x, seq, r.size):
            return gather_sequence_to_tp(x, r.group, r.device)
        return copy_to_tp(x, r.group, r.device)

    def _leave(self, y: Any) -> Any:
        """g, or g-bar under sequence parallelism (the output cut into pieces)."""
        r = self.tp_rank
        if self.seq:
            return reduce_scatter_from_tp(y, r.group, r.device)
        return reduce_from_tp(y, r.group, r.device)

    def _out_sequence(self, shape: Any, whole: bool) -> Any:
        """An output shape with its sequence axis whole (``whole``) or a piece, under
        sequence parallelism; unchanged without it."""
        if not self.seq or len(shape) < 2:
            return tuple(shape)
        return (shape[0], self.seq if whole else self.seq // self.tp_rank.size, *shape[2:])

    def _add_row_bias(self, shape: Any) -> None:
        self.row_bias = self.add_weight(name="bias", shape=tuple(shape),
                                        initializer=self.bias_initializer,
                                        regularizer=self.bias_regularizer,
                                        constraint=self.bias_constraint)

    def _split_call(self, inputs: Any, product: Any, sliced_in: int) -> Any:
        """Column: f, the rank's slice of the product (and bias), ``_column_out``. Row: a
        whole input cut to the rank's ``sliced_in`` features, g on the partial product,
        then the whole bias and the activation."""
        r = self.tp_rank
        if r.split == "column":
            y = product(self._enter(inputs, self.seq))
            if self.bias is not None:
                y = ops.add(y, self.bias)
            return _column_out(self, y)
        x = inputs
        if self.seq and _is_piece(x, self.seq, r.size):  # a piece: whole again first
            x = gather_from_sequence(x, r.group, r.device)
        if x.shape[-1] == self.full_in and self.full_in != sliced_in:
            x = scatter_to_tp(x, r.group, r.device)
        y = self._leave(product(x))
        if self.row_bias is not None:
            y = ops.add(y, self.row_bias)
        return y if self.activation is None else self.activation(y)


class RankDense(_RankTwin, keras.layers.Dense):
    def __init__(self, rank: Rank, full_units: int, **config: Any) -> None:
        self.tp_rank, self.full_units = rank, full_units
        self.full_use_bias = config.get("use_bias", True)
        config["units"] = full_units // rank.size if rank.split == "column" else full_units
        if rank.split == "row":
            config["use_bias"] = False  # the row split adds the whole bias after g
        super().__init__(**config)

    def build(self, input_shape: Any) -> None:
        self.full_in = int(input_shape[-1])
        self.seq = self._sequence_of(input_shape)
        if self.tp_rank.split == "row":
            own = slice_sizes(self.full_in, self.tp_rank.size)[self.tp_rank.index]
            input_shape = (*input_shape[:-1], own)
        super().build(input_shape)
        self.input_spec = None  # a row split reads a slice or the whole input
        if self.tp_rank.split == "row" and self.full_use_bias:
            self._add_row_bias((self.full_units,))

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self._split_call(inputs, lambda x: ops.matmul(x, self.kernel),
                                self.kernel.shape[0])

    def compute_output_shape(self, input_shape: Any) -> Any:
        units = self.units if self.tp_rank.split == "column" and not self.tp_rank.gather_output \
            else self.full_units
        return self._out_sequence((*input_shape[:-1], units), self.tp_rank.split == "column")

    def rank_axes(self) -> list[int | None]:
        if self.tp_rank.split == "column":
            return [1, 0] if self.use_bias else [1]
        return [0, None] if self.row_bias is not None else [0]


def _column_out(layer: Any, y: Any) -> Any:
    """A column split's output: its activation, and the all-gather unless a row split
    reads the slice (an activation that is not elementwise runs on the gathered whole)."""
    r, act = layer.tp_rank, layer.activation
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
        self.tp_rank = rank
        self._specs = einsum_specs(config["equation"])
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
        self.seq = self._sequence_of(input_shape)
        self.kernel_axis = ker.index(out[-1] if self.tp_rank.split == "column" else inp[-1])
        if self.tp_rank.split == "row":
            _, bias_shape, _ = compat.analyze_einsum_string(
                self.equation, self.full_bias_axes, input_shape, self.partial_output_shape)
            input_shape = (*input_shape[:-1], self.full_in // self.tp_rank.size)
        super().build(input_shape)
        self.input_spec = None
        if self.tp_rank.split == "row" and self.full_bias_axes:
            self._add_row_bias(bias_shape)

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self._split_call(inputs, lambda x: ops.einsum(self.equation, x, self.kernel),
                                self.kernel.shape[self.kernel_axis])

    def compute_output_shape(self, input_shape: Any) -> Any:
        if self.seq:  # the shape of the whole sequence's product, then its sequence axis
            input_shape = (input_shape[0], self.seq, *input_shape[2:])
        return self._out_sequence(super().compute_output_shape(input_shape),
                                  self.tp_rank.split == "column")

    def rank_axes(self) -> list[int | None]:
        if self.tp_rank.split == "column":
            axes: list[int | None] = [self.kernel_axis]
            if self.bias is not None:
                sliced = self._specs[2][-1] in (self.bias_axes or "")
                axes.append(len(self.bias.shape) - 1 if sliced else None)
            return axes
        return [self.kernel_axis] + ([None] if self.row_bias is not None else [])


class RankHeadsProjection(_RankTwin, keras.layers.EinsumDense):
    """One projection of an attention block split by heads (module docstring): ``role``
    "input" (the kernel's ``heads_axis`` is an output axis: its slice, and the bias's) or
    "output" (a contracted axis: its slice, g, then the whole bias)."""

    def __init__(self, rank: Rank, role: str, heads_axis: int, **config: Any) -> None:
        self.tp_rank, self.role, self.heads_axis = rank, role, heads_axis
        _, ker, out = einsum_specs(config["equation"])
        self._char = ker[heads_axis]
        self.full_bias_axes = config.get("bias_axes")
        if role == "input":
            shape = list(config["output_shape"])  # the output's axes after the batch's
            shape[out.index(self._char) - 1] //= rank.size
            config["output_shape"] = shape
        else:
            config["bias_axes"] = None  # the whole bias, added after g
        super().__init__(**config)

    def build(self, input_shape: Any) -> None:
        inp = einsum_specs(self.equation)[0]
        if self.role == "output":
            _, bias_shape, _ = compat.analyze_einsum_string(
                self.equation, self.full_bias_axes, input_shape, self.partial_output_shape)
            input_shape = list(input_shape)
            axis = inp.index(self._char)
            input_shape[axis] = int(input_shape[axis]) // self.tp_rank.size
        super().build(tuple(input_shape))
        self.input_spec = None
        if self.role == "output" and self.full_bias_axes:
            self._add_row_bias(bias_shape)

    def call(self, inputs: Any, training: Any = None) -> Any:
        y = super().call(inputs)
        if self.role == "input":
            return y
        y = reduce_from_tp(y, self.tp_rank.group, self.tp_rank.device)
        return y if self.row_bias is None else y + ops.cast(self.row_bias, y.dtype)

    def rank_axes(self) -> list[int | None]:
        axes: list[int | None] = [self.heads_axis]
        if self.role == "input" and self.bias is not None:
            # Keras' bias spans the output's axes from its first bias axis on (1 elsewhere)
            bias_axes, out = self.bias_axes or "", einsum_specs(self.equation)[2]
            first = min(out.index(c) for c in bias_axes)
            axes.append(out.index(self._char) - first if self._char in bias_axes else None)
        elif self.role == "output" and self.row_bias is not None:
            axes.append(None)
        return axes


class _RankConv(_RankTwin):
    """A convolution (channels last, groups 1) split by its filters (column: the kernel's
    last axis and the bias) or its input channels (row: the kernel's axis -2, the input
    cut to the rank's channels, g on the partial convolution, then the whole bias and the
    activation), as a Dense layer by units or inputs."""

    def __init__(self, rank: Rank, full_filters: int, **config: Any) -> None:
        self.tp_rank, self.full_filters = rank, full_filters
        self.full_use_bias = config.get("use_bias", True)
        config["filters"] = full_filters // rank.size if rank.split == "column" \
            else full_filters
        if rank.split == "row":
            config["use_bias"] = False  # the row split adds the whole bias after g
        super().__init__(**config)

    def build(self, input_shape: Any) -> None:
        self.full_in = int(input_shape[-1])
        if self.tp_rank.split == "row":
            own = slice_sizes(self.full_in, self.tp_rank.size)[self.tp_rank.index]
            input_shape = (*input_shape[:-1], own)
        super().build(input_shape)
        self.input_spec = None  # a row split reads a slice or the whole input
        if self.tp_rank.split == "row" and self.full_use_bias:
            self._add_row_bias((self.full_filters,))

    def call(self, inputs: Any) -> Any:
        return self._split_call(inputs, lambda x: self.convolution_op(x, self.kernel),
                                int(self.kernel.shape[-2]))

    def compute_output_shape(self, input_shape: Any) -> Any:
        shape = list(super().compute_output_shape(input_shape))
        if self.tp_rank.split == "row" or self.tp_rank.gather_output:
            shape[-1] = self.full_filters
        return tuple(shape)

    def rank_axes(self) -> list[int | None]:
        last = len(self.kernel.shape) - 1
        if self.tp_rank.split == "column":
            return [last, 0] if self.use_bias else [last]
        return [last - 1, None] if self.row_bias is not None else [last - 1]


class RankConv1D(_RankConv, keras.layers.Conv1D):
    pass


class RankConv2D(_RankConv, keras.layers.Conv2D):
    pass


class RankConv3D(_RankConv, keras.layers.Conv3D):
    pass


CONV_TYPES = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
CONV_TWINS = {keras.layers.Conv1D: RankConv1D, keras.layers.Conv2D: RankConv2D,
              keras.layers.Conv3D: RankConv3D}


class RankEmbedding(_RankTwin, keras.layers.Embedding):
    def __init__(self, rank: Rank, full_input_dim: int, **config: Any) -> None:
        self.tp_rank, self.full_input_dim = rank, full_input_dim
        config["input_dim"] = full_input_dim // rank.size
        super().__init__(**config)

    def call(self, inputs: Any) -> Any:
        r = self.tp_rank
        if inputs.dtype not in ("int32", "int64"):
            inputs = ops.cast(inputs, "int32")
        lo = r.index * self.input_dim
        local = inputs - ops.cast(lo, inputs.dtype)
        inside = ops.logical_and(local >= 0, local < self.input_dim)
        rows = ops.take(self.embeddings, ops.where(inside, local, ops.zeros_like(local)), axis=0)
        rows = ops.where(ops.expand_dims(inside, -1), rows, ops.zeros_like(rows))
        return self._leave(rows)

    def build(self, input_shape: Any = None) -> None:
        super().build(input_shape)
        if input_shape is not None:  # ids [batch, seq]: the output cut is [batch, seq, dim]
            self._SEQ_MIN_RANK = 2
            self.seq = self._sequence_of(input_shape)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return self._out_sequence(super().compute_output_shape(input_shape), False)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return None if not self.mask_zero else ops.not_equal(inputs, 0)

    def rank_axes(self) -> list[int | None]:
        return [0]


class _RankHeads(_RankTwin):
    """A rank's heads of an attention layer: f (f-bar) once per distinct input, its heads'
    projections and attention, g (g-bar) on the output projection's product, then its
    bias. Subclasses give ``_project`` and ``_core`` (Keras' own computation)."""

    kv_seq: int | None = None

    def call(self, query: Any, value: Any, key: Any = None, query_mask: Any = None,
             value_mask: Any = None, key_mask: Any = None, attention_mask: Any = None,
             return_attention_scores: bool = False, training: Any = None,
             use_causal_mask: bool = False, cache: Any = None,
             cache_update_index: Any = None) -> Any:
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
        copied: dict[int, Any] = {}  # f once per distinct input (self-attention: once)

        def f(x: Any, seq: int | None) -> Any:
            if id(x) not in copied:
                copied[id(x)] = self._enter(x, seq)
            return copied[id(x)]

        query, key, value = f(query, self.seq), f(key, self.kv_seq), f(value, self.kv_seq)
        q, k, v = self._project(query, key, value)
        r = self.tp_rank
        if r.cp_group is not None:  # every chunk's keys and values (apply.spmd.context)
            k = all_gather_sequence(k, r.cp_group, r.device, "cp")
            v = all_gather_sequence(v, r.cp_group, r.device, "cp")
            attention_mask = context_mask(r.cp_group, r.device, ops.shape(q)[1],
                                          ops.shape(k)[1], query_mask, value_mask, key_mask,
                                          use_causal_mask)
        else:
            attention_mask = compat.attention_mask(  # of the whole sequences
                self, query, value, query_mask=query_mask, value_mask=value_mask,
                key_mask=key_mask, attention_mask=attention_mask,
                use_causal_mask=use_causal_mask)
        out, scores = self._core(q, k, v, attention_mask, training, return_attention_scores)
        dense = compat.attention_projection(self, "output")
        y = self._leave(ops.einsum(dense.equation, out, dense.kernel))
        if dense.bias is not None:
            y = ops.add(y, dense.bias)
        if query_mask is not None:
            compat.set_keras_mask(y, query_mask)
        if not return_attention_scores:
            return y
        return y, gather_heads_from_tp(scores, self.tp_rank.group, self.tp_rank.device)

    def _project(self, query: Any, key: Any, value: Any) -> tuple[Any, Any, Any]:
        return tuple(compat.attention_projection(self, part)(x)  # type: ignore[return-value]
                     for part, x in (("query", query), ("key", key), ("value", value)))

    def _core(self, q: Any, k: Any, v: Any, mask: Any, training: Any, scores: bool
              ) -> tuple[Any, Any]:
        raise NotImplementedError

    def build(self, query_shape: Any, value_shape: Any, key_shape: Any = None) -> None:
        super().build(query_shape, value_shape, key_shape)
        self.seq, self.kv_seq = self._sequence_of(query_shape), self._sequence_of(value_shape)

    def compute_output_shape(self, query_shape: Any, value_shape: Any,
                             key_shape: Any = None) -> Any:
        return self._out_sequence(super().compute_output_shape(
            query_shape, value_shape, key_shape), False)

    def compute_output_spec(self, query: Any, value: Any, key: Any = None, *args: Any,
                            return_attention_scores: bool = False, **kwargs: Any) -> Any:
        shape = self.compute_output_shape(query.shape, value.shape,
                                          None if key is None else key.shape)
        out = keras.KerasTensor(shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        scores = (query.shape[0], self.full_heads, self.seq or query.shape[1],
                  self.kv_seq or value.shape[1])  # every head's, over whole sequences
        return out, keras.KerasTensor(scores, dtype=self.compute_dtype)

    def rank_axes(self) -> list[int | None]:
        # query, key, value: kernel [model, heads, dim] by heads, bias [heads, dim]; the
        # output: kernel [heads, dim, model] by heads, the whole bias
        bias = compat.attention_projection(self, "output").bias is not None
        per_projection = [1, 0] if bias else [1]
        out = [0, None] if bias else [0]
        return per_projection * 3 + out


class RankMultiHeadAttention(_RankHeads, keras.layers.MultiHeadAttention):
    """Heads [t h/tp, (t+1) h/tp); keras_hub's CachedMultiHeadAttention's training call
    (no cache) is this computation too."""

    def __init__(self, rank: Rank, full_heads: int, **config: Any) -> None:
        self.tp_rank, self.full_heads = rank, full_heads
        config["num_heads"] = full_heads // rank.size
        super().__init__(**config)

    def _core(self, q: Any, k: Any, v: Any, mask: Any, training: Any, scores: bool
              ) -> tuple[Any, Any]:
        return compat.attention_scores(self, q, k, v, mask, training, scores)


class RankGroupQueryAttention(_RankHeads, keras.layers.GroupQueryAttention):
    """Query heads [t u/tp, (t+1) u/tp) and the key/value heads they read, [t v/tp,
    (t+1) v/tp) (Keras repeats key/value head j for query heads j r .. j r + r - 1,
    r = u / v, so contiguous slices of both stay matched)."""

    def __init__(self, rank: Rank, full_heads: int, full_kv_heads: int, **config: Any
                 ) -> None:
        self.tp_rank, self.full_heads, self.full_kv_heads = rank, full_heads, full_kv_heads
        config["num_query_heads"] = full_heads // rank.size
        config["num_key_value_heads"] = full_kv_heads // rank.size
        super().__init__(**config)

    def _core(self, q: Any, k: Any, v: Any, mask: Any, training: Any, scores: bool
              ) -> tuple[Any, Any]:
        k, v = ops.repeat(k, self.num_repeats, axis=2), ops.repeat(v, self.num_repeats, axis=2)
        return compat.grouped_attention_scores(self, q, k, v, mask, training, scores)


def _is_piece(x: Any, seq: int, tp: int) -> bool:
    """Whether ``x`` is one of tp pieces of a sequence of ``seq`` (its axis 1 is seq / tp)."""
    shape = tuple(x.shape)
    return len(shape) >= 2 and shape[1] is not None and int(shape[1]) * tp == seq


def is_attention_block(layer: Any) -> bool:
    """An attention block split by heads in place (``apply.spmd.attention_block``): not
    Keras' MultiHeadAttention or GroupQueryAttention (this module's twins), recognised by
    ``profiler.attention_blocks``."""
    from tfplan.profiler.attention_blocks import attention_block

    if isinstance(layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)) \
            or is_cached_attention(layer):
        return False
    return attention_block(layer) is not None


def attention_block_problem(layer: Any, tp: int) -> str:
    """Why the attention block ``layer`` (``is_attention_block``) cannot be split by heads
    over ``tp`` ("" when it can; its projections: ``profiler.split_rules``)."""
    from tfplan.profiler.attention_blocks import attention_block

    info = attention_block(layer)
    if info.query_heads % tp or info.kv_heads % tp:
        return f"it has {info.query_heads} query and {info.kv_heads} key/value heads"
    return split_refusal(layer, "heads")


def split_problem(layer: Any, split: str, tp: int) -> str:
    """Why ``layer`` cannot be split by ``split`` over ``tp`` ranks here ("" when it can):
    its configuration (``profiler.split_rules.split_refusal``, the rule the planner's
    profile records), then the degree. A row split's input may cut unequally (its partial
    sums are whole); a column split's output must cut equally (its slices are gathered
    or read as they are)."""
    why = split_refusal(layer, split)
    if why:
        return why
    cls = type(layer)
    if split == "heads" and cls is keras.layers.GroupQueryAttention:
        heads = (layer.num_query_heads, layer.num_key_value_heads)
        return "" if all(h % tp == 0 for h in heads) else \
            f"its {heads[0]} query and {heads[1]} key/value heads"
    if split == "heads" and is_attention_block(layer):
        return attention_block_problem(layer, tp)
    if split == "heads":
        return "" if layer.num_heads % tp == 0 else f"its {layer.num_heads} heads"
    if split == "vocab":
        return "" if layer.input_dim % tp == 0 else f"its vocabulary of {layer.input_dim}"
    if cls is keras.layers.Dense:
        n = layer.units if split == "column" else int(layer.kernel.shape[0])
        return "" if n % tp == 0 or (split == "row" and n >= tp) else \
            f"its {'units' if split == 'column' else 'inputs'} ({n})"
    if cls in CONV_TYPES:
        n = layer.filters if split == "column" else int(layer.kernel.shape[-2])
        return "" if n % tp == 0 or (split == "row" and n >= tp) else \
            f"its {'filters' if split == 'column' else 'input channels'} ({n})"
    char, _ = einsum_split_axis(layer.equation, split)  # an EinsumDense (split_refusal)
    n = int(layer.kernel.shape[einsum_specs(layer.equation)[1].index(char)])
    return "" if n % tp == 0 else f"its split axis ({n})"


def rank_twin(layer: Any, rank: Rank) -> Any:
    """The rank's twin of ``layer`` (unbuilt), from the unsplit layer's config."""
    config = layer_config(layer)
    if type(layer) in CONV_TYPES:
        config.pop("filters", None)
        return CONV_TWINS[type(layer)](rank, layer.filters, **config)
    if rank.split == "heads" and isinstance(layer, keras.layers.GroupQueryAttention):
        config.pop("num_query_heads", None)
        config.pop("num_key_value_heads", None)
        return RankGroupQueryAttention(rank, layer.num_query_heads, layer.num_key_value_heads,
                                       **config)
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


__all__ = ["Rank", "RankHeadsProjection", "attention_block_problem", "is_attention_block", "RankConv1D", "RankConv2D", "RankConv3D", "RankDense", "RankEinsumDense", "RankEmbedding", "RankGroupQueryAttention",
           "RankMultiHeadAttention", "is_twin", "rank_twin", "split_problem"]
