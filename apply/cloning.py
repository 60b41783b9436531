"""Re-creating the user's model layer by layer, with each layer built where the plan says.

Pipeline position: inside ``apply.wrap``, after the plan has been checked
against the model and its devices exist; ``apply.data_parallel`` and
``apply.pipeline`` turn the graph cloned here into the model they return.

Keras 3 creates a layer's variables where the layer is *built* (DESIGN.md), so
placement happens at clone time: ``keras.models.clone_model`` re-creates each
layer (``clone_function``) and calls it on new symbolic inputs
(``call_function``), which builds it; both run under ``tf.device`` of the
layer's device (the creation covers variables made in ``__init__``, such as a
Dropout's seed state). Under a ``tf.distribute`` scope the same clone builds
distributed variables instead. Weights are then copied layer by layer, by name.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

from tfplan.core.errors import PlannerError


def to_functional(model: Any) -> Any:
    """A new, uncompiled Functional model over ``model``'s own layers (no copies).

    Sequential models become Functional here; Functional ones get an uncompiled
    twin so that ``clone_model`` does not compile (and build optimizer slots for)
    a throw-away clone. Subclassed models cannot be re-wired and are refused.
    """
    from tfplan.compat import functional_class

    Functional = functional_class()
    if not is_graph_model(model):
        raise PlannerError(
            f"apply.wrap received a {type(model).__name__}, a subclassed keras.Model; it "
            "needs a Functional or Sequential model, whose layer graph it can re-create on "
            "the plan's devices. Rewrite build_model() with keras.Input and layer calls "
            "(the Functional API), or as a keras.Sequential.")
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise PlannerError(
            f"Model {model.name!r} has no defined inputs (it was never built on an input "
            "shape). Start it with keras.Input(shape=...) or build it before apply.wrap.")
    return Functional(inputs, outputs, name=model.name)


def is_graph_model(model: Any) -> bool:
    """Whether ``model`` is a Functional or Sequential model (a layer graph that can be
    re-wired), not a subclassed one."""
    import keras

    from tfplan.compat import functional_class

    return isinstance(model, (functional_class(), keras.Sequential))


def clone_layer(layer: Any) -> Any:
    """A new layer from ``layer``'s config (unbuilt: it builds where it is first called);
    ``profiler.signature.layer_config`` reads the constructor's arguments back where
    ``get_config`` itself fails."""
    from tfplan.profiler.signature import layer_config

    try:
        return layer.__class__.from_config(layer_config(layer))
    except Exception as e:
        clone = _from_own_arguments(layer)
        if clone is not None:
            return clone
        raise PlannerError(
            f"apply.wrap re-creates every layer from its config to build it on the plan's "
            f"device, and layer {layer.name!r} ({type(layer).__name__}) could not be: "
            f"{type(e).__name__}: {e}. Pass apply.wrap the function that builds the model "
            "instead, apply.wrap(build_model, plan): each device then builds its copy with "
            "your code, nothing is re-created. Or give that layer class a get_config() that "
            "returns its constructor arguments (and a from_config() if they are not plain "
            "values)."
        ) from e


_PLAIN = (str, int, float, bool, type(None))


def _from_own_arguments(layer: Any) -> Any:
    """``layer`` re-created from its own constructor arguments alone, where its class
    takes no ``**kwargs`` (keras.io tutorials' ``def __init__(self, patch_size):
    super().__init__()``, whose ``from_config`` fails on the ``name`` Keras adds): the
    arguments Keras recorded for it (its default ``get_config``) or that it keeps under
    the same names, when they are all plain values (numbers, strings, booleans, None,
    lists of them), then its name, ``trainable`` and dtype policy set as the layer's.
    None where that does not apply or the constructor refuses them."""
    import inspect

    from tfplan.profiler.signature import layer_config

    try:
        params = inspect.signature(type(layer).__init__).parameters
        config = layer_config(layer)
    except Exception:  # noqa: BLE001 -- no config to build from: the caller refuses
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    own = {k: v for k, v in config.items() if k in params and k != "self"}
    if not all(isinstance(v, _PLAIN) or (isinstance(v, (list, tuple)) and
                                         all(isinstance(x, _PLAIN) for x in v))
               for v in own.values()):
        return None
    try:
        clone = type(layer)(**own)
    except Exception:  # noqa: BLE001 -- the caller refuses with the builder form
        return None
    clone.name = layer.name
    clone.trainable = layer.trainable
    if clone.dtype_policy.name != layer.dtype_policy.name:
        clone.dtype_policy = layer.dtype_policy
    return clone


def clone_graph(model: Any, device_of_layer: Mapping[str, str] | None = None,
                device_of_entry: Mapping[str, str] | None = None,
                weights_device: Any = None) -> Any:
    """Clone ``model`` (Functional) with fresh layers; ``device_of_layer`` places each build.

    Layers missing from ``device_of_layer`` (or all of them when it is None) are
    built in the current device/strategy scope. ``device_of_entry`` (a plan's
    ``device_of_layer()``: qualified names): the layers of a nested model go to their own
    devices (``apply.blocks.place_nested``) instead of all on the nested model's, their
    weights to ``weights_device(device)`` when given (``apply.offload``).
    """
    import keras
    import tensorflow as tf

    from tfplan.apply.blocks import placed_clone

    def where(layer: Any) -> Any:
        dev = (device_of_layer or {}).get(layer.name)
        return tf.device(dev) if dev else contextlib.nullcontext()

    def clone_function(layer: Any) -> Any:
        with where(layer):
            clone = clone_layer(layer)
        return placed_clone(layer, clone, device_of_entry, weights_device)

    def call_function(layer: Any, *args: Any, **kwargs: Any) -> Any:
        with where(layer):
            return layer(*args, **kwargs)

    return keras.models.clone_model(model, clone_function=clone_function,
                                    call_function=call_function)


def copy_weights(source: Any, target: Any) -> None:
    """Copy every layer's weights from ``source`` to the same-named layer of ``target``
    (unsplit: a layer holding sharded sub-layers takes the user's arrays,
    ``apply.blocks.set_unsplit_weights``)."""
    from tfplan.apply.blocks import holds_shards, set_unsplit_weights

    for layer in source.layers:
        weights = layer.get_weights()
        if weights:
            twin = target.get_layer(layer.name)
            if holds_shards(twin):
                set_unsplit_weights(twin, weights)
            else:
                twin.set_weights(weights)

