"""A model's identity as a plan sees it: (layer name, layer type, parameter count).

Pipeline position: shared by the profiler (``ModelProfile.signature()`` is built
from the same rule) and by ``apply`` (which checks a plan against the model it
is asked to wrap). Works on any Keras 3 model object; imports nothing heavy.

The rule: the layers of ``model.layers`` in order, without ``InputLayer``s,
with every nested ``keras.Model`` replaced by its own layers (recursively),
named ``outer/inner`` (``/`` joins the nested model's name and the layer's).
A *block* -- a layer that is not Keras' own (nor a subclass of one of Keras'
layers), that owns sub-layers (keras_hub's transformer blocks and attention layers,
a user's composite layer) -- is listed too, followed by its sub-layers, named
``block/sub`` (recursively: ``block/attention/query``): the block's entry stands for
what the block does itself (its own weights, the ops of its ``call`` outside any
sub-layer); each sub-layer's entry for that sub-layer (``is_block``, ``block_of``).
A layer reachable twice (shared between models) is listed once, where it is
first met. A shared layer called several times is one entry.

A plan matches its model by structure, position by position in that order (the
layer's type, parameter count and, where known, ``output_shape``: its output per
sample, batch dimension dropped), not by the names Keras generates
(``dense_1`` in a process that built another model first); see ``Plan.for_model``.
"""
from __future__ import annotations

from typing import Any

SEPARATOR = "/"


def keras_base_type(layer: Any) -> str | None:
    """The class name of the first of Keras' own layer classes (those ``keras.layers``
    exports, but ``Layer`` itself) that ``layer`` is or derives from: ``MultiHeadAttention``
    for keras_hub's ``CachedMultiHeadAttention``, ``Dense`` for a ``Dense``; None for a
    layer that derives from ``keras.layers.Layer`` only."""
    exported = _keras_layer_classes()
    for cls in type(layer).__mro__:
        if cls in exported:
            return cls.__name__
    return None


_EXPORTED: set[type] = set()


def _keras_layer_classes() -> set[type]:
    """The layer classes ``keras.layers`` exports (under any of their names), but
    ``Layer`` itself."""
    if not _EXPORTED:
        import keras

        _EXPORTED.update(v for v in vars(keras.layers).values()
                         if isinstance(v, type) and issubclass(v, keras.layers.Layer)
                         and v is not keras.layers.Layer)
    return _EXPORTED


def layer_config(layer: Any) -> dict[str, Any]:
    """``layer.get_config()`` (with the plain constructor arguments it drops put back:
    ``_with_dropped_arguments``); where that raises (keras_hub 0.32's
    ``LlamaTransformerDecoder.get_config`` reads an attribute its ``__init__`` never sets,
    ``rope_scaling_factor``), the layer's constructor arguments read back from the
    attributes of the same names (``__init__``'s parameters that the layer keeps), with
    Keras' own ``name``, ``trainable`` and ``dtype``. Raises the original error when
    neither gives a config."""
    import inspect

    import keras

    def plain(value: Any) -> Any:  # Keras objects (initializers, activations) serialized
        if callable(value) or hasattr(value, "get_config"):
            return keras.saving.serialize_keras_object(value)
        return value

    try:
        return _with_dropped_arguments(layer, dict(layer.get_config()))
    except Exception as error:  # noqa: BLE001 -- the fallback below, or this error
        try:
            params = inspect.signature(type(layer).__init__).parameters
        except (TypeError, ValueError):
            raise error from None
        config: dict[str, Any] = {"name": layer.name, "trainable": layer.trainable,
                                  "dtype": plain(layer.dtype_policy)}
        for name, p in params.items():
            if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if hasattr(layer, name):
                config[name] = plain(getattr(layer, name))
            elif p.default is p.empty:
                raise error from None  # a required argument the layer does not keep
        return config


def _with_dropped_arguments(layer: Any, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` plus each constructor argument it leaves out that the layer keeps under
    the same name as a plain value (number, string, bool) other than the default: keras_hub
    0.32's ``MixtralTransformerDecoder.get_config`` drops ``router_aux_loss_coef``, so a
    copy made from its config would train with the default 0.02 instead of the user's."""
    import inspect

    try:
        params = inspect.signature(type(layer).__init__).parameters
    except (TypeError, ValueError):
        return config
    for name, p in params.items():
        if name in config or name == "self" or p.default is p.empty or \
                p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = getattr(layer, name, p.default)
        if isinstance(value, (bool, int, float, str)) and type(value) is type(p.default) \
                and value != p.default:
            config[name] = value
    return config


def sublayers(layer: Any) -> list[Any]:
    """The layers ``layer`` tracks directly (its attributes, lists and dicts of layers),
    in the order it made them."""
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:
        return []
    return list(flatten(include_self=False, recursive=False))


def call_order(block: Any, problems: list[str] | None = None) -> dict[int, int]:
    """{id(layer): rank} of ``block`` and the layers inside it, in the order its call
    enters them: its call is replayed on the arguments of its first call in the model's
    graph (``compute_output_spec``: symbolic, nothing runs, no graph node is added).
    {} when the block has no such call or the replay fails (the declared order is kept,
    and ``problems`` gets a line saying so)."""
    import keras

    from tfplan import compat

    nodes = compat.inbound_nodes(block)
    if not nodes:
        return {}
    order: dict[int, int] = {}
    original = keras.Layer.__call__

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        order.setdefault(id(self), len(order))
        return original(self, *args, **kwargs)

    def dense(x: Any) -> Any:  # Keras marks some op outputs sparse=True (Multiply)
        if isinstance(x, keras.KerasTensor) and x.sparse:
            return keras.KerasTensor(x.shape, x.dtype, name=x.name)
        return x

    try:
        args, kwargs = compat.node_call_arguments(nodes[0])
        args, kwargs = keras.tree.map_structure(dense, (args, kwargs))
        keras.Layer.__call__ = recording
        compat.replay_symbolically(block.call, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- any failure: keep the declared order, say so
        if problems is not None:
            problems.append(
                f"block {block.name} ({type(block).__name__}): replaying its call to learn the "
                f"order of its sub-layers failed ({type(e).__name__}: {str(e)[:200]}); they are "
                "listed in the order it made them, which may not be the order it calls them")
        return {}
    finally:
        keras.Layer.__call__ = original
    return order


def is_block(layer: Any) -> bool:
    """Whether the profile walks into ``layer``: it is not Keras' own (nor a subclass of
    one of Keras' layers, which the planner and ``apply`` treat as that layer), not a
    model (a nested model's layers are listed in its place), and owns sub-layers."""
    import keras

    return (not isinstance(layer, keras.Model) and keras_base_type(layer) is None
            and bool(sublayers(layer)))


def profiled_layer_paths(model: Any, problems: list[str] | None = None
                         ) -> list[tuple[str, Any]]:
    """(qualified name, layer) for each layer a profile and a plan talk about, in order.

    Keras 3 ``model.layers`` is a topological order for Functional models and the
    call order for Sequential ones (attribute order for subclassed models); a
    nested model's layers take its place in that order; a block's sub-layers follow
    the block's own entry, in the order the block made them.
    """
    import keras

    paths: list[tuple[str, Any]] = []
    seen: set[int] = set()
    order: dict[int, int] = {}

    def visit_block(block: Any, prefix: str) -> None:
        names: set[str] = set()
        inner = sublayers(block)
        ranked = sorted(range(len(inner)), key=lambda i: (order.get(id(inner[i]), len(order)), i))
        for layer in (inner[i] for i in ranked):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            name, k = layer.name, 1
            while name in names:  # two sub-layers of one block with one name
                name, k = f"{layer.name}_{k}", k + 1
            names.add(name)
            add(prefix + name, layer)

    def add(name: str, layer: Any) -> None:
        paths.append((name, layer))
        if is_block(layer):
            if id(layer) not in order:  # an outermost block: its replay ranks the inner ones
                order.update(call_order(layer, problems))
            visit_block(layer, name + SEPARATOR)

    def visit(container: Any, prefix: str) -> None:
        for layer in container.layers:
            if id(layer) in seen or type(layer).__name__ == "InputLayer":
                continue
            seen.add(id(layer))
            if isinstance(layer, keras.Model):
                visit(layer, f"{prefix}{layer.name}{SEPARATOR}")
            else:
                add(prefix + layer.name, layer)

    visit(model, "")
    return paths


def block_of(paths: list[tuple[str, Any]]) -> dict[str, str]:
    """{qualified name: the qualified name of the outermost block it belongs to} for each
    entry of ``profiled_layer_paths`` that is a block or inside one (a block's own entry
    maps to itself): a pipeline stage boundary may fall between blocks only."""
    blocks = {name for name, layer in paths if is_block(layer)}
    out: dict[str, str] = {}
    for name, _ in paths:
        parts = name.split(SEPARATOR)
        for i in range(1, len(parts) + 1):
            prefix = SEPARATOR.join(parts[:i])
            if prefix in blocks:
                out[name] = prefix
                break
    return out


def own_weights(layer: Any) -> list[Any]:
    """The variables of ``layer`` itself: all of them for a layer the profile does not
    walk into, those not held by a sub-layer for a block (each sub-layer has its entry)."""
    if not is_block(layer):
        return list(layer.weights)
    inner = {id(v) for sub in sublayers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in inner]


def own_params(layer: Any) -> int:
    """Parameters of ``own_weights``."""
    import math

    return sum(math.prod(int(d) for d in v.shape) for v in own_weights(layer))


def profiled_layers(model: Any) -> list[Any]:
    """The layer objects of ``profiled_layer_paths``, in the same order."""
    return [layer for _, layer in profiled_layer_paths(model)]


def model_signature(model: Any) -> tuple[tuple[str, str, int], ...]:
    """(qualified name, class name, count_params()) for each profiled layer, in order."""
    return tuple((name, type(layer).__name__, own_params(layer))
                 for name, layer in profiled_layer_paths(model))


def output_shape(layer: Any) -> tuple[int | None, ...] | None:
    """The layer's output shape per sample (batch dimension dropped; None for a dynamic
    dimension), or None where it has no single symbolic output (a layer called several
    times, one with several outputs, a subclassed model's sub-layer)."""
    try:
        out = layer.output
    except (AttributeError, ValueError, RuntimeError):
        return None
    shape = getattr(out, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return tuple(None if d is None else int(d) for d in tuple(shape)[1:])


def output_shapes(model: Any) -> tuple[tuple[int | None, ...] | None, ...]:
    """``output_shape`` of each profiled layer, in ``profiled_layer_paths`` order."""
    return tuple(output_shape(layer) for _, layer in profiled_layer_paths(model))
