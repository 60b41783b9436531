"""Activation recomputation: what a plan recomputes, run under ``tf.recompute_grad``.

Pipeline position: inside ``apply.wrap``, in every mode, when
``plan.strategy.recompute`` is not ``"none"``. ``recomputed_layers`` picks the
model's top-level layers to recompute (and those kept because they hold state);
``split_recompute`` says how: whole layers (their names go to the mode's model, which
runs each of them through ``recompute_call`` where it calls the layer: under its
device in ``apply.pipeline``, in each replica in ``apply.data_parallel``) or only the
attention core (``recompute_attention_cores``, after the model is built). Either way
the backward pass re-runs the recomputed forward ops instead of reading activations
kept from the forward pass (Chen et al., 2016, "Training deep nets with sublinear
memory cost"; TensorFlow's own ``tf.recompute_grad``, which keeps only the inputs).

* ``"full"``: every top-level layer (of every stage) is recomputed, one
  checkpoint per layer: each layer keeps its inputs and recomputes its inner
  activations (the planner's cost model prices one checkpoint per stage, which
  keeps less; per layer is what a functional graph allows without re-wiring);
* ``"selective"``: Megatron's selective recomputation (Korthikanti et al., 2022,
  "Reducing Activation Recomputation in Large Transformer Models", Sec. 5): only the
  attention core of each attention layer (``profiler.comm.HEAD_SPLIT_TYPES``:
  MultiHeadAttention, GroupedQueryAttention, and the head-split
  ``apply.sharded_layers.ShardedMultiHeadAttention``) is recomputed: the scores QK^T,
  the softmax and scores x V, whose activations grow with the sequence length
  squared. The Q/K/V and output projections keep their activations, and layers
  without attention recompute nothing. The core is the layer's
  ``_compute_attention``, replaced on each instance (``compat.wrap_attention_core``)
  by one under ``tf.recompute_grad``; a nested model's attention layers too. The
  recomputation is created where the core runs (each tensor rank's heads on its
  device under tensor parallelism; ``tf.gradients`` colocates a gradient function's
  ops with its forward op).

Recomputing gives the same numbers as keeping the activations, except where the
forward pass changes state: a layer with non-trainable variables
(BatchNormalization's moving statistics, Dropout's seed-generator state) would
update them twice or draw a different random mask in the recomputation. Such layers
are kept, not recomputed, and ``recomputed_layers`` says which (``apply.wrap`` warns).
Under ``"selective"`` that is an attention layer with attention dropout
(``dropout > 0``: its core draws a mask from the layer's seed generator), judged by
the attention layers alone (a nested model's other state does not matter).
"""
from __future__ import annotations

from typing import Any, Callable, Collection

from tfplan import compat
from tfplan.planner.plan import Plan
from tfplan.profiler.comm import HEAD_SPLIT_TYPES


def recomputed_layers(plan: Plan, view: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(top-level layers of ``view`` to recompute, those left out because they hold state).

    ``view``: the Functional model ``apply.wrap`` re-creates (its layer names are
    the first part of the plan's layer names).
    """
    mode = plan.strategy.recompute
    if mode == "none":
        return (), ()
    wanted = {name.split("/", 1)[0] for name, _, _ in plan.model_signature}
    chosen, stateful = [], []
    for layer in view.layers:
        if layer.name not in wanted:
            continue
        holders = [layer] if mode == "full" else attention_layers(layer)
        if not holders:  # selective: no attention in it
            continue
        has_state = any(h.non_trainable_variables for h in holders)
        (stateful if has_state else chosen).append(layer.name)
    return tuple(chosen), tuple(stateful)


def split_recompute(plan: Plan, chosen: Collection[str]
                    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(layers recomputed whole, layers whose attention core alone is recomputed) for
    ``chosen`` (``recomputed_layers``' first part), as ``plan.strategy.recompute`` says."""
    if plan.strategy.recompute == "selective":
        return (), tuple(chosen)
    return tuple(chosen), ()


def attention_layers(layer: Any) -> list[Any]:
    """The attention layers (``HEAD_SPLIT_TYPES`` and their subclasses, keras_hub's
    ``CachedMultiHeadAttention`` among them) in ``layer``: the layer itself, or those of a
    nested model or a block (``profiler.signature.is_block``: a custom layer with
    sub-layers), at any depth -- the layers whose cores the planner's selective
    recomputation prices (a custom attention layer's own core is not one of them)."""
    from tfplan.profiler.signature import is_block, sublayers

    if any(cls.__name__ in HEAD_SPLIT_TYPES for cls in type(layer).__mro__):
        return [layer]
    inner = sublayers(layer) if is_block(layer) else getattr(layer, "layers", ())
    return [a for sub in inner for a in attention_layers(sub)]


def recompute_attention_cores(model: Any, names: Collection[str]) -> int:
    """Recompute the attention core of layers ``names`` in ``model`` and in its other
    data-parallel copies (``model.replica_models()``); returns how many cores."""
    count = 0
    for copy in model.replica_models():
        for name in names:
            for layer in attention_layers(copy.get_layer(name)):
                if not compat.attention_core_is_wrapped(layer):  # layers shared by copies
                    compat.wrap_attention_core(layer, recompute_call)
                    count += 1
    model.recompute_cores = frozenset(names)
    return count


def recompute_call(fn: Callable[..., Any], tape_only: bool = False) -> Callable[..., Any]:
    """``fn`` (one layer's call) wrapped so its forward ops are re-run in the backward pass.

    ``tf.recompute_grad`` (a ``tf.custom_gradient``) accepts only tensors as
    positional arguments in a graph, so the call's tensors are passed flat and
    everything else (keyword arguments such as ``training``, masks, Python values,
    the nesting) is bound here. Called under the layer's ``tf.device``, so the
    recomputation is created next to the forward op (``tf.gradients`` colocates a
    gradient function's ops with its forward op). ``tape_only`` (for steps that
    differentiate with a ``tf.GradientTape``, as ``apply.spmd``'s): a tensor the tape does
    not record (the model's input) is read through ``tf.stop_gradient`` in the recomputed
    forward, so no gradient is computed for it (``tf.recompute_grad`` differentiates every
    tensor it is passed; under tensor parallelism that gradient would be all-reduced).
    """
    import keras
    import tensorflow as tf

    def run(*args: Any, **kwargs: Any) -> Any:
        structure = (args, kwargs)
        leaves = keras.tree.flatten(structure)
        is_tensor = [tf.is_tensor(leaf) and leaf.dtype.is_floating for leaf in leaves]
        tensors = [leaf for leaf, t in zip(leaves, is_tensor) if t]
        if not tensors:  # nothing to differentiate through
            return fn(*args, **kwargs)
        constant = [tape_only and not compat.on_gradient_path(t) for t in tensors]

        def forward(*inputs: Any) -> Any:
            it = iter(tf.stop_gradient(x) if c else x for x, c in zip(inputs, constant))
            filled = [next(it) if t else leaf for leaf, t in zip(leaves, is_tensor)]
            a, k = keras.tree.pack_sequence_as(structure, filled)
            return fn(*a, **k)

        return tf.recompute_grad(forward)(*tensors)

    return run
