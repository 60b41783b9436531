"""A custom attention block split by heads as a whole: its own ``call`` run once per rank.

Pipeline position: ``apply.blocks.shard_inside`` replaces a plan's ``(block, "heads")``
entry -- an attention block recognised by ``profiler.attention_blocks.attention_block``
(keras_hub's ``LlamaAttention``, ``CachedGemmaAttention``, a user's) -- by a
``ShardedAttentionBlock`` in its parent, in place, once the block's clone is built.
Megatron-LM's attention split (Shoeybi et al. 2019, Sec. 3): rank t holds query heads
[t q/tp, (t+1) q/tp) and key/value heads [t kv/tp, (t+1) kv/tp) (tp must divide kv;
the groups q/kv are contiguous, so each query head stays with its key/value head):

* its *input* projections (query, key, value: EinsumDense with a heads output axis) are
  rank-local EinsumDense layers whose kernel (and bias) is the unsplit one's slice along
  that axis; its *output* projection's kernel is sliced along its contracted heads axis,
  without bias; each rank's are built under ``tf.device`` of the rank;
* a *view* of the block per rank (a shallow copy of it, made without Keras' tracking,
  whose projection attributes are the rank's layers and whose head-count attributes,
  ``AttentionBlock.heads_attributes``, hold q/tp and kv/tp) runs the block's own ``call``
  under that rank's device; the other sub-layers (rotary embedding, softmax, dropout,
  norms) are shared by the views;
* the ranks' outputs are summed (``tf.add_n``) on the layer's device, where the output
  projection's bias is added once.

Before training the split is checked: on one small random input shaped as the block's
call in the model (``first_calls``: its parent run once eagerly, its arguments recorded),
the ranks' sum must equal the unsplit block's output (rtol 1e-5); otherwise a
PlannerError refuses it (its ``call`` mixes heads, or reads a head count other than its
``heads_attributes``). The unsplit projections are then dropped: the rank layers' variables
are the ones trained. Weights read and write unsplit (``Sharded``: ``full_weights``,
``full_pieces`` per unsplit weight with its shards' axis; weight files through entries at
the projections' attribute names, as ``apply.sharded_attention``), in the block's
``weights`` order. Training calls only: a call that returns a key/value cache is refused.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.layer_tree import references, scopes_of
from tfplan.apply.sharded_attention import ProjectionEntry
from tfplan.apply.sharded_base import Sharded, assign_pieces, concat_variables
from tfplan.core.errors import PlannerError

RTOL = 1e-5


class _Hidden:
    """A plain holder: neither Keras' tracker nor its weight files look inside."""

    def __init__(self, **items: Any) -> None:
        self.__dict__.update(items)


# --- the arguments of a block's first call -----------------------------------------------------

class _Spec:
    def __init__(self, shape: Any, dtype: Any) -> None:
        self.shape = tuple(None if d is None else int(d) for d in shape)
        self.dtype = tf.as_dtype(dtype)


def _spec(x: Any) -> Any:
    if isinstance(x, (tf.Tensor, keras.KerasTensor, tf.Variable)) or keras.ops.is_tensor(x):
        return _Spec(x.shape, x.dtype)
    return x


@contextlib.contextmanager
def recording_calls(classes: Iterable[type]) -> Iterator[dict[int, Any]]:
    """{id(layer): (args, kwargs) of its first call, tensors as shapes and dtypes} for each
    layer of ``classes`` called inside the ``with`` (their class's ``call`` is wrapped
    meanwhile; ``functools.wraps`` keeps its signature for Keras)."""
    calls: dict[int, Any] = {}
    saved = []
    for cls in dict.fromkeys(classes):
        own = cls.__dict__.get("call")
        saved.append((cls, own))
        cls.call = _recorder(cls.call, calls)
    try:
        yield calls
    finally:
        for cls, own in saved:
            if own is None:
                del cls.call
            else:
                cls.call = own


def _recorder(original: Any, calls: dict[int, Any]) -> Any:
    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if id(self) not in calls:
            calls[id(self)] = tf.nest.map_structure(_spec, (args, kwargs))
        return original(self, *args, **kwargs)
    return call


def first_calls(top: Any, args: Sequence[Any], kwargs: dict[str, Any],
                classes: Sequence[type]) -> dict[int, Any]:
    """``recording_calls`` of ``classes`` while ``top`` (a built layer holding attention
    blocks) runs once eagerly on small random arguments shaped as ``args``, ``kwargs`` (its
    symbolic call in the model: keras_hub's blocks state their output shape, so their
    symbolic call never enters the attention's ``call``); {} without ``classes``."""
    if not classes:
        return {}
    sample = _sample(tf.nest.map_structure(_spec, (tuple(args), dict(kwargs))))
    with recording_calls(classes) as calls, tf.init_scope():
        top(*sample[0], **sample[1])
    return calls


def _sample(recorded: Any, seed: int = 0) -> tuple[tuple, dict]:
    """Random eager arguments shaped as ``recorded`` (unknown sizes: batch 2, others 4;
    integer and boolean tensors as 0/1 masks), ``training`` False."""
    rng = np.random.default_rng(seed)

    def make(x: Any) -> Any:
        if not isinstance(x, _Spec):
            return x
        shape = [d if d is not None else (2 if i == 0 else 4) for i, d in enumerate(x.shape)]
        if x.dtype.is_bool:
            return tf.constant(rng.random(shape) < 0.8)
        if x.dtype.is_integer:
            return tf.constant((rng.random(shape) < 0.8).astype(x.dtype.as_numpy_dtype))
        return tf.constant(rng.normal(size=shape).astype(x.dtype.as_numpy_dtype))

    args, kwargs = tf.nest.map_structure(make, recorded)
    if "training" in kwargs:
        kwargs = {**kwargs, "training": False}
    return tuple(args), dict(kwargs)


# --- the split ---------------------------------------------------------------------------------

def _attribute(block: Any, sub: Any, what: str) -> str:

    for ref in references(block, sub):
        if ref[0] == "attr":
            return ref[1]
    raise PlannerError(f"Attention block {block.name!r} holds its {what} {sub.name!r} in no "
                       "attribute of its own, so apply cannot give each rank its own. Split "
                       "its projections column/row instead.")


def _slice(value: np.ndarray, axis: int, t: int, tp: int) -> np.ndarray:
    n = value.shape[axis] // tp
    return np.take(value, np.arange(t * n, (t + 1) * n), axis=axis)


class ShardedAttentionBlock(Sharded, keras.layers.Layer):
    """An attention block split by heads (module docstring): ``rank_layers()[t]`` are rank
    t's projections (in the block's order), run by rank t's view of the block."""

    def __init__(self, block: Any, devices: Sequence[str], plan_name: str,
                 recorded: Any) -> None:
        from tfplan.profiler.attention_blocks import attention_block
        from tfplan.profiler.signature import sublayers

        super().__init__(name=block.name, dtype=block.dtype_policy)
        self._init_tp("heads", devices)
        found = attention_block(block)
        tp = len(self.tp_devices)
        where = f"Plan {plan_name!r} splits attention block {block.name!r} " \
                f"({type(block).__name__}) by heads"
        if found is None:
            raise PlannerError(f"{where}, but apply does not recognise it as one "
                               "(profiler.attention_blocks). Split its projections instead.")
        if found.kv_heads % tp:
            raise PlannerError(f"{where} over tp={tp}; it has {found.kv_heads} key/value "
                               "heads, and tp must divide them (each rank holds whole "
                               "key/value heads with their query heads). Use such a tp, or "
                               "split its projections column/row.")
        projections = {id(p.layer): p for p in found.projections}
        attrs = {id(p.layer): _attribute(block, p.layer, "projection") for p in found.projections}
        ranks: list[list[Any]] = [[] for _ in range(tp)]
        pieces: dict[int, tuple[tuple[Any, ...], int | None]] = {}
        self._tp_bias = None
        for p in found.projections:
            layers, kernel, bias = self._split(p, tp, where)
            for t, rank in enumerate(layers):
                ranks[t].append(rank)
            pieces[id(p.layer.kernel)] = kernel
            if bias is not None:
                pieces[id(p.layer.bias)] = bias
        order = [pieces.get(id(v), ((v,), None)) for v in block.weights]
        inner = {id(v) for sub in sublayers(block) for v in sub.weights}
        own = [v for v in block.weights if id(v) not in inner]
        heads = dict(zip(found.heads_attributes, (found.query_heads // tp, found.kv_heads // tp)))
        views = []
        for t in range(tp):
            view = object.__new__(type(block))  # no __init__, no tracking: the block's state
            view.__dict__.update(block.__dict__)
            for p, rank in zip(found.projections, ranks[t]):
                view.__dict__[attrs[id(p.layer)]] = rank
            view.__dict__.update(heads)
            views.append(view)
        self._tp = _Hidden(views=tuple(views), ranks=tuple(tuple(r) for r in ranks),
                           pieces=tuple(order), own=tuple(own))
        self._check(block, recorded, where, found.heads_attributes)
        # the block's other sub-layers, shared by the views, at their attribute names; the
        # projections' unsplit weights at theirs (weight files); the unsplit projections go
        for sub in sublayers(block):
            if id(sub) in projections:
                entry = self._entry(sub, pieces)
                compat.replace_tracked_layer(block, sub, entry)
                compat.set_untracked_attribute(block, attrs[id(sub)], entry)
                setattr(self, attrs[id(sub)], entry)
            else:
                setattr(self, _attribute(block, sub, "sub-layer"), sub)
        self._tp_variables = [v for r in ranks for rank in r for v in rank.weights] + own
        self.built = True

    def _split(self, p: Any, tp: int, where: str) -> tuple[list[Any], tuple, tuple | None]:
        """Projection ``p`` cut by heads: (its rank layers, each on its rank's device, with
        their slices of its weights; its kernel's (shards, axis); its bias's, or None). The
        output projection's ranks have no bias: ``_tp_bias`` on rank 0, added once."""

        layer = p.layer
        linear = layer.activation in (None, keras.activations.linear)
        if getattr(layer, "lora_enabled", False) or (p.role == "output" and not linear):
            raise PlannerError(f"{where}: its projection {layer.name!r} has LoRA or an "
                               "output activation, which a heads split cannot sum. Split "
                               "its projections instead.")
        inp, rest = layer.equation.split(",")
        ker, out = rest.split("->")
        letter = ker[p.heads_axis]
        config = layer.get_config()
        shape = dict(compat.build_arguments(layer))
        key = next(iter(shape))
        kernel = layer.kernel.numpy()
        bias = layer.bias.numpy() if layer.bias is not None else None
        bias_axis = None
        if p.role == "input":
            partial = list(config["output_shape"]) if isinstance(
                config["output_shape"], (list, tuple)) else [config["output_shape"]]
            partial[out.index(letter) - 1] = p.heads // tp
            config["output_shape"] = tuple(partial)
            if bias is not None:
                axes = config.get("bias_axes") or ""
                if letter not in axes:
                    raise PlannerError(f"{where}: projection {layer.name!r}'s bias is "
                                       "shared by all heads, which a heads split cannot "
                                       "keep whole. Split its projections instead.")
                first = min(out.index(a) for a in axes)
                bias_axis = out.index(letter) - first
        else:
            config["bias_axes"] = None
            dims = list(shape[key])
            dims[inp.index(letter)] = p.heads // tp
            shape[key] = tuple(dims)
            if bias is not None:
                with tf.device(self.tp_devices[0]), scopes_of(layer):
                    self._tp_bias = self.add_weight(
                        name=f"{layer.name}_bias", shape=bias.shape,
                        initializer="zeros", dtype=layer.bias.dtype)
                self._tp_bias.assign(bias)
        shards_k, shards_b, layers = [], [], []
        for t, device in enumerate(self.tp_devices):
            rank = keras.layers.EinsumDense.from_config(
                {**config, "name": f"{layer.name}_{t}"})
            with tf.device(device), scopes_of(layer):
                rank.build(**shape)
            rank.kernel.assign(_slice(kernel, p.heads_axis, t, tp))
            if p.role == "input" and bias is not None:
                rank.bias.assign(_slice(bias, bias_axis, t, tp))
                shards_b.append(rank.bias)
            shards_k.append(rank.kernel)
            layers.append(rank)
        pieces = None if bias is None else (
            (tuple(shards_b), bias_axis) if p.role == "input" else ((self._tp_bias,), None))
        return layers, (tuple(shards_k), p.heads_axis), pieces

    def _entry(self, layer: Any, pieces: dict) -> Any:
        """A weight-file entry for projection ``layer``: its unsplit kernel and bias."""
        parts = [pieces[id(layer.kernel)]] + (
            [pieces[id(layer.bias)]] if layer.bias is not None else [])

        def read() -> list[np.ndarray]:
            return [_joined(s, a) for s, a in parts]

        def write(weights: Sequence[Any]) -> None:
            for (s, a), w in zip(parts, weights):
                _assign(s, a, np.asarray(w))
        return ProjectionEntry(read, write, name=layer.name)

    def rank_layers(self) -> tuple[tuple[Any, ...], ...]:
        """Each rank's projections (a method: weight files do not walk into them)."""
        return self._tp.ranks

    def _check(self, block: Any, recorded: Any, where: str, names: Sequence[str]) -> None:
        if recorded is None:
            raise PlannerError(f"{where}, but its call was not seen while the model was "
                               "cloned, so apply cannot check the split. Split its "
                               "projections column/row instead.")
        with tf.init_scope():
            args, kwargs = _sample(recorded)
            with tf.device(self.tp_devices[0]):
                want = keras.ops.convert_to_numpy(block(*args, **kwargs))
            got = keras.ops.convert_to_numpy(
                self._sum([v(*args, **kwargs) for v in self._ranked()]))
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        if got.shape != want.shape or not np.allclose(got, want, rtol=RTOL,
                                                      atol=RTOL * scale):
            raise PlannerError(
                f"{where}, but the sum of its ranks' outputs differs from the unsplit "
                "block's on a random input: its call does not compute each head apart from "
                "the others (or it reads a head count other than "
                f"{', '.join(names)}). Leave it whole: split its "
                "projections column/row, or remove it from tp_splits.")

    def _ranked(self) -> Iterator[Any]:
        """Each view, called under its rank's device."""
        for view, device in zip(self._tp.views, self.tp_devices):
            def run(*args: Any, view: Any = view, device: str = device, **kwargs: Any) -> Any:
                with tf.device(device):
                    out = view(*args, **kwargs)
                if isinstance(out, (tuple, list)):
                    raise PlannerError(
                        f"Attention block {self.name!r} is split by heads and returned "
                        "several outputs (a key/value cache: generation); the split block "
                        "runs training and evaluation calls only. Generate with the user's "
                        "model: load the wrapped model's save_weights file into it.")
                return out
            yield run

    def _sum(self, partial: list[Any]) -> Any:
        y = tf.add_n(partial)
        return y if self._tp_bias is None else y + keras.ops.cast(self._tp_bias, y.dtype)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self._sum([run(*args, **kwargs) for run in self._ranked()])

    # unsplit weights, in the block's order (apply.sharded_base.Sharded)
    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        return list(self._tp.pieces)

    def full_weights(self) -> list[np.ndarray]:
        return [_joined(s, a) for s, a in self._tp.pieces]

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        for (s, a), w in zip(self._tp.pieces, weights):
            _assign(s, a, np.asarray(w))

    # weight files: the projections' entries hold them, the shared sub-layers their own;
    # the block's own variables (if any) as the block saves them
    def save_own_variables(self, store: Any) -> None:
        for i, v in enumerate(self._tp.own):
            store[str(i)] = v.numpy()

    def load_own_variables(self, store: Any) -> None:
        for i, v in enumerate(self._tp.own):
            v.assign(np.asarray(store[str(i)]))


def _joined(shards: Sequence[Any], axis: int | None) -> np.ndarray:
    return shards[0].numpy() if axis is None else concat_variables(shards, axis)


def _assign(shards: Sequence[Any], axis: int | None, value: np.ndarray) -> None:
    if axis is None:
        shards[0].assign(value)
    else:
        assign_pieces(shards, value, axis)

