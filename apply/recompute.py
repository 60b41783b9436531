"""Activation recomputation: the layers a plan recomputes, run under ``tf.recompute_grad``.

Pipeline position: inside ``apply.wrap`` for single-device and pipeline plans
(``apply.pipeline``), when ``plan.strategy.recompute`` is not ``"none"``.
``recomputed_layers`` picks the model's top-level layers to recompute;
``PlacedModel`` then runs each of them through ``recompute_call`` where it runs
the layer under its device, so the backward pass re-runs that layer's forward
ops instead of reading activations kept from the forward pass (Chen et al.,
2016, "Training deep nets with sublinear memory cost"; TensorFlow's own
``tf.recompute_grad``, which keeps only the layer's inputs).

* ``"full"``: every top-level layer (of every stage) is recomputed, one
  checkpoint per layer: each layer keeps its inputs and recomputes its inner
  activations (the planner's cost model prices one checkpoint per stage, which
  keeps less; per layer is what a functional graph allows without re-wiring);
* ``"selective"``: attention layers only (``profiler.comm.HEAD_SPLIT_TYPES``,
  as the planner prices it; Korthikanti et al., 2022); a nested model that holds
  an attention layer is recomputed whole, since ``apply`` places and calls a
  nested model as one operation.

Recomputing a layer gives the same numbers as keeping its activations, except for
layers whose forward pass changes state: a layer with non-trainable variables
(BatchNormalization's moving statistics, Dropout's seed-generator state) would
update them twice or draw a different random mask in the recomputation. Such
layers are kept, not recomputed, and ``recomputed_layers`` says which.
"""
from __future__ import annotations

from typing import Any, Callable

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
    if mode == "full":
        wanted = {name.split("/", 1)[0] for name, _, _ in plan.model_signature}
    else:  # selective
        wanted = {name.split("/", 1)[0] for name, kind, _ in plan.model_signature
                  if kind in HEAD_SPLIT_TYPES}
    chosen, stateful = [], []
    for layer in view.layers:
        if layer.name not in wanted:
            continue
        (stateful if layer.non_trainable_variables else chosen).append(layer.name)
    return tuple(chosen), tuple(stateful)


def recompute_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (one layer's call) wrapped so its forward ops are re-run in the backward pass.

    ``tf.recompute_grad`` (a ``tf.custom_gradient``) accepts only tensors as
    positional arguments in a graph, so the call's tensors are passed flat and
    everything else (keyword arguments such as ``training``, masks, Python values,
    the nesting) is bound here. Called under the layer's ``tf.device``, so the
    recomputation is created next to the forward op (``tf.gradients`` colocates a
    gradient function's ops with its forward op).
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

        def forward(*inputs: Any) -> Any:
            it = iter(inputs)
            filled = [next(it) if t else leaf for leaf, t in zip(leaves, is_tensor)]
            a, k = keras.tree.pack_sequence_as(structure, filled)
            return fn(*a, **k)

        return tf.recompute_grad(forward)(*tensors)

    return run
