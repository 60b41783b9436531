"""Inside blocks and nested models: sub-layers split in place, and nested layers placed.

Pipeline position: under ``apply.tensor_parallel`` and ``apply.pipeline``, after the
plan has been matched to the model (``Plan.for_model``). A plan names what sits inside
a top-level layer by path (``profiler.signature``): ``block/sub`` for the sub-layers
of a *block* (a custom layer with sub-layers: keras_hub's transformer blocks and
attention layers, a user's composite layer), ``model/layer`` for the layers of a
nested model (a keras_hub backbone called inside a Functional model). Here:

* **Splits inside blocks** (``resolve_splits``, ``shard_inside``): a ``tp_splits``
  entry may name a block's sub-layer at any depth (``llama/transformer_layer_0/
  self_attention/query``). Once the block's clone is built (from its config, or inside
  its nested model's clone, on its stage's device), the sub-layer is replaced by its
  sharded twin (``apply.sharded_layers.sharded_clone``: same config, shards on the
  stage's tensor ranks) *in place*: in the parent's attribute, list or dict that held
  it (found by identity in the user's model, followed by name in the clone) and in
  the layers Keras tracks for the parent (``compat.replace_tracked_layer``: same
  position, so ``weights`` keep their order). The twin is built with the shapes the
  unsplit sub-layer was built with (``compat.build_arguments``). The block's own code
  runs unchanged on its stage's rank 0: a column-split sub-layer gives it the whole
  (concatenated) output, a row-split one reads a column split's shards in place when
  its input is that concatenation and slices its input otherwise, attention split by
  heads sums its ranks' outputs. A direct layer of a nested model cannot be split
  (the nested model's graph holds it); the error says so. An attention block named
  itself with ``heads`` (``profiler.attention_blocks``: keras_hub's ``LlamaAttention``)
  is replaced whole by ``apply.sharded_attention_block.ShardedAttentionBlock`` (its own
  ``call`` once per rank on that rank's heads), checked on the arguments its call
  received when the parent ran once eagerly (``first_calls``).
* **Unsplit weights** (``unsplit_weights``, ``set_unsplit_weights``,
  ``unsplit_layout``): a layer that holds sharded twins reads, writes and lays out its
  weights as the user's layer (each twin's unsplit arrays where the unsplit sub-layer's
  were), so ``get_weights``/``set_weights`` and checkpoints match the user's model.
  Weight files match by themselves: a twin sits under the parent's attribute name and
  saves its unsplit arrays.
* **Nested models across stages** (``place_nested``): a nested model is re-created
  whole from its config (keras_hub's blocks need not re-create from theirs) on the
  device of its first stage; the weights of its layers planned on other stages are
  then moved there (``compat.move_variable``), and, when it spans devices, each of its
  operations runs on its layer's device (``compat.place_operations``). Each top-level
  layer of a nested model (a block with its sub-layers) sits on one stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tfplan import compat
from tfplan.apply.device_names import short_name
from tfplan.apply.layer_tree import Step, references, scopes_of
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import Plan
from tfplan.profiler.signature import (SEPARATOR, block_of, keras_base_type,
                                       profiled_layer_paths)



@dataclass(frozen=True)
class InnerSplit:
    """A ``tp_splits`` entry that names a sub-layer inside top-level layer ``top``:
    ``steps`` lead from ``top`` to the sub-layer's parent (last step: the sub-layer)."""

    name: str
    top: str
    steps: tuple[Step, ...]
    split: str
    block_class: Any = None  # an attention block split by heads whole: its class


def resolve_splits(view: Any, plan: Plan) -> tuple[dict[str, str], dict[str, list[InnerSplit]]]:
    """(``{top-level layer: split}``, ``{top-level layer: [InnerSplit, ...]}``) of
    ``plan.tp_splits`` on ``view``; PlannerError for a name the model does not have or
    a layer directly inside a nested model."""
    from tfplan.apply.dimensions import split_refusal
    from tfplan.profiler.attention_blocks import attention_block

    paths = profiled_layer_paths(view)
    entries = dict(paths)
    blocks = block_of(paths)
    top_splits: dict[str, str] = {}
    inner: dict[str, list[InnerSplit]] = {}
    for name, split in plan.tp_splits:
        if name not in entries:
            raise PlannerError(f"Plan {plan.name!r} splits layer {name!r}, which model "
                               f"{view.name!r} does not have. Re-plan for this model.")
        layer = entries[name]
        attention = attention_block(layer)
        why = split_refusal(name, type(layer).__name__, keras_base_type(layer) or "",
                            blocks.get(name, ""), split,
                            attention_heads=attention.query_heads if attention else 0)
        if why:
            raise PlannerError(
                f"Plan {plan.name!r} splits layer {name!r} ({type(layer).__name__}) by "
                f"{split!r}, which apply cannot run: {why}. Leave that layer replicated (remove it from tp_splits) or "
                "re-plan.")
        whole = attention is not None and split == "heads"
        if whole:
            _check_attention_place(view, entries, name, attention, plan)
        if SEPARATOR not in name:
            top_splits[name] = split
            continue
        chain = _chain(view, entries, name)
        top = name.split(SEPARATOR, 1)[0]
        steps = tuple(_step(p, c) for p, c in zip(chain[1:-1], chain[2:]))
        inner.setdefault(top, []).append(InnerSplit(name, top, steps, split,
                                                    type(layer) if whole else None))
    return top_splits, inner


def _check_attention_place(view: Any, entries: Mapping[str, Any], name: str,
                           attention: Any, plan: Plan) -> None:
    """PlannerError unless attention block ``name`` sits inside a block (where its split
    twin replaces it in place) and the plan's tp divides its key/value heads."""
    import keras

    tp = plan.strategy.tp
    where = (f"Plan {plan.name!r} splits attention block {name!r} "
             f"({type(entries[name]).__name__}) by heads")
    parent = _chain(view, entries, name)[-2] if SEPARATOR in name else view
    if isinstance(parent, keras.Model):
        raise PlannerError(f"{where}; apply splits an attention block by heads inside a "
                           "block (a transformer block) only, not as a layer of a model, "
                           "whose graph holds it. Leave it whole or split its projections "
                           "column/row.")
    if attention.kv_heads % tp:
        raise PlannerError(f"{where} over tp={tp}; it has {attention.kv_heads} key/value "
                           "heads, and tp must divide them (each rank holds whole key/value "
                           "heads with their query heads). Use such a tp, or split its "
                           "projections column/row.")


def _chain(view: Any, entries: Mapping[str, Any], name: str) -> list[Any]:
    """[view, each layer on the way to ``name`` (nested models and blocks), the layer]."""
    parts = name.split(SEPARATOR)
    chain = [view]
    for i in range(1, len(parts) + 1):
        found = entries.get(SEPARATOR.join(parts[:i]))
        if found is None:  # a nested model: not an entry of its own
            found = chain[-1].get_layer(parts[i - 1])
        chain.append(found)
    return chain


def _step(parent: Any, child: Any) -> Step:
    """How ``parent`` holds ``child``: by name in a model, else the attribute (or the
    attribute's list index / dict key) that holds it, found by identity."""
    import keras

    if isinstance(parent, keras.Model):
        return ("layer", child.name)
    found = references(parent, child)
    if not found:
        raise PlannerError(
            f"Layer {child.name!r} is tracked by block {parent.name!r} but held by none of "
            "its attributes, lists or dicts, so apply cannot put a split twin in its place. "
            "Leave it replicated (remove it from tp_splits).")
    return found[0]


def follow(obj: Any, step: Step) -> Any:
    """The layer ``step`` leads to from ``obj``."""
    if step[0] == "layer":
        return obj.get_layer(step[1])
    value = getattr(obj, step[1])
    return value if step[0] == "attr" else value[step[2]]


def swap_in(parent: Any, old: Any, new: Any) -> None:
    """Put ``new`` wherever ``parent`` holds ``old`` (attributes, lists, dicts) and in the
    layers Keras tracks for it, at ``old``'s position."""
    refs = references(parent, old)
    if not refs:
        raise PlannerError(f"Block {parent.name!r} holds layer {old.name!r} in none of its "
                           "attributes, lists or dicts; apply cannot replace it.")
    compat.replace_tracked_layer(parent, old, new)
    for ref in refs:
        if ref[0] == "attr":
            setattr(parent, ref[1], new)  # already tracked: Keras adds nothing
            continue
        holder = getattr(parent, ref[1])
        if isinstance(holder, tuple):
            setattr(parent, ref[1], type(holder)(new if v is old else v for v in holder))
        else:
            holder[ref[2]] = new


def shard_inside(top: Any, splits: Sequence[InnerSplit],
                 devices_of: Callable[[str], Sequence[str]], plan_name: str,
                 calls: Mapping[int, Any] | None = None) -> None:
    """Replace, inside ``top`` (a built clone of a block or nested model), each split
    sub-layer by its sharded twin on ``devices_of(name)`` (its stage's tp devices of this
    replica), built on rank 0 with the unsplit sub-layer's build shapes; an attention
    block split by heads by ``apply.sharded_attention_block.ShardedAttentionBlock``,
    checked on its first call's arguments (``calls``: ``recording_calls``)."""
    import tensorflow as tf

    from tfplan.apply.sharded_attention_block import ShardedAttentionBlock
    from tfplan.apply.sharded_layers import sharded_clone

    for s in splits:
        parent = top
        for step in s.steps[:-1]:
            parent = follow(parent, step)
        old = follow(parent, s.steps[-1])
        devices = tuple(devices_of(s.name))
        if s.block_class is not None:
            with tf.device(devices[0]):
                twin = ShardedAttentionBlock(old, devices, plan_name,
                                             (calls or {}).get(id(old)))
            swap_in(parent, old, twin)
            continue
        try:
            shapes = compat.build_arguments(old)
        except PlannerError as e:
            raise PlannerError(f"Plan {plan_name!r} splits layer {s.name!r}: {e} Leave it "
                               "replicated (remove it from tp_splits).") from e
        twin = sharded_clone(old, s.split, devices, plan_name)
        with tf.device(devices[0]), scopes_of(old):  # variable paths as the unsplit's
            twin.build(**shapes)
        swap_in(parent, old, twin)


def holds_shards(layer: Any) -> bool:
    """Whether ``layer`` is, or holds at any depth, a sharded twin."""
    from tfplan.apply.sharded_base import Sharded

    if isinstance(layer, Sharded):
        return True
    return any(holds_shards(sub) for sub in _sublayers(layer))


# --- unsplit weights -------------------------------------------------------------------------

def _sublayers(layer: Any) -> list[Any]:
    flatten = getattr(layer, "_flatten_layers", None)
    return list(flatten(include_self=False, recursive=False)) if flatten else []


def _handles(layer: Any, seen: set[int]) -> list[tuple[Any, int | None]]:
    """``layer.weights`` in Keras' order (its own variables, then each tracked sub-layer's,
    depth first, each once) with every sharded twin's shards replaced by its unsplit
    weights: (variable, None) or (twin, index into its ``full_weights``)."""
    from tfplan.apply.sharded_base import Sharded

    if isinstance(layer, Sharded):
        if id(layer) in seen:
            return []
        seen.add(id(layer))
        return [(layer, i) for i in range(len(layer.full_pieces()))]
    subs = _sublayers(layer)
    inner = {id(v) for sub in subs for v in sub.weights}
    out: list[tuple[Any, int | None]] = []
    for v in layer.weights:
        if id(v) not in inner and id(v) not in seen:
            seen.add(id(v))
            out.append((v, None))
    for sub in subs:
        out += _handles(sub, seen)
    return out


def _trainable(handle: tuple[Any, int | None], layer_trainable: bool) -> bool:
    obj, i = handle
    if not layer_trainable:
        return False
    if i is None:
        return bool(obj.trainable)
    return bool(obj.trainable) and bool(obj.full_pieces()[i][0][0].trainable)


def unsplit_weights(layer: Any) -> list[np.ndarray]:
    """``layer.get_weights()`` of the user's layer (sharded twins read unsplit)."""
    out = []
    for obj, i in _handles(layer, set()):
        out.append(obj.numpy() if i is None else obj.full_weights()[i])
    return out


def set_unsplit_weights(layer: Any, weights: Sequence[Any]) -> None:
    """``layer.set_weights`` with the user's layer's arrays (split onto the twins)."""
    handles = _handles(layer, set())
    if len(handles) != len(weights):
        raise ValueError(f"Layer {layer.name!r} has {len(handles)} weight arrays (unsplit, as "
                         f"the original layer); set_weights received {len(weights)}.")
    pending: dict[int, tuple[Any, list[Any]]] = {}
    for (obj, i), w in zip(handles, weights):
        if i is None:
            obj.assign(np.asarray(w))
        else:
            pending.setdefault(id(obj), (obj, []))[1].append(np.asarray(w))
    for twin, arrays in pending.values():
        twin.set_full_weights(arrays)


def unsplit_layout(layer: Any) -> list[Any]:
    """One ``apply.checkpoint.CanonicalWeight`` per trainable weight of the user's layer, in
    its order: a twin's shards with their concatenation axis (``full_pieces``)."""
    from tfplan.apply.checkpoint import CanonicalWeight

    out = []
    trainable = bool(getattr(layer, "trainable", True))
    for obj, i in _handles(layer, set()):
        if not _trainable((obj, i), trainable):
            continue
        if i is None:
            out.append(CanonicalWeight(((obj,),)))
        else:
            shards, axis = obj.full_pieces()[i]
            out.append(CanonicalWeight((tuple(shards),), axis))
    return out


# --- nested models across stages ---------------------------------------------------------------

def nested_spans(plan: Plan) -> dict[str, tuple[str, ...]]:
    """{nested model (top-level name): its devices in stage order} for each nested model
    whose layers the plan puts on several devices (replica 0's)."""
    entries = plan.device_of_layer()
    devices: dict[str, list[str]] = {}
    for name, device in entries.items():
        top = name.split(SEPARATOR, 1)[0]
        if top not in entries:  # a nested model (a block is an entry of its own)
            devices.setdefault(top, []).append(device)
    return {top: tuple(dict.fromkeys(ds)) for top, ds in devices.items()
            if len(set(ds)) > 1}


def place_nested(original: Any, clone: Any, device_of_entry: Mapping[str, str],
                 prefix: str, weights_device: Callable[[str], str] | None = None) -> None:
    """Move the weights of ``clone`` (a nested model re-created whole from ``original``'s
    config) to the devices ``device_of_entry`` gives its layers (qualified names,
    ``prefix`` + name; ``weights_device(device)`` when given: ``apply.offload``), nested
    models inside it too, and run each of its operations on its layer's device when they
    are several."""
    import keras

    from tfplan.apply.placement import operation_devices

    own: dict[str, str] = {}
    for layer in original.layers:
        if type(layer).__name__ == "InputLayer":
            continue
        twin = clone.get_layer(layer.name)
        name = prefix + layer.name
        if isinstance(layer, keras.Model):
            place_nested(layer, twin, device_of_entry, name + SEPARATOR, weights_device)
            device = next((d for n, d in device_of_entry.items()
                           if n.startswith(name + SEPARATOR)), None)
        else:
            device = device_of_entry.get(name)
            if device is not None:
                _move_variables(layer, twin, weights_device(device) if weights_device
                                else device)
        if device is not None:
            own[layer.name] = device
    if len(set(own.values())) > 1:
        first = next(iter(own.values()))
        devices = operation_devices(clone, own, first)
        compat.place_operations(clone, lambda op, fn: _on(devices.get(id(op)), fn))


def _move_variables(layer: Any, twin: Any, device: str) -> None:
    mine, theirs = list(layer.variables), list(twin.variables)
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:
        raise PlannerError(
            f"Layer {layer.name!r} ({type(layer).__name__}) re-created from its nested "
            "model's config does not have the same variables as the original, so apply "
            "cannot place it.")
    want = short_name(device)
    for v in theirs:
        if short_name(v.value.device) != want:
            compat.move_variable(v, device)


def _on(device: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    import tensorflow as tf

    if device is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device):
            return fn(*args, **kwargs)
    return run


def placed_clone(layer: Any, clone: Any, device_of_entry: Mapping[str, str] | None,
                 weights_device: Callable[[str], str] | None = None) -> Any:
    """``clone`` (a nested model re-created from ``layer``) with ``place_nested`` applied
    when ``device_of_entry`` is given and ``layer`` is a model; else ``clone``."""
    import keras

    if device_of_entry and isinstance(layer, keras.Model):
        place_nested(layer, clone, device_of_entry, layer.name + SEPARATOR, weights_device)
    return clone

