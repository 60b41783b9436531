"""A model's identity as a plan sees it: (layer name, layer type, parameter count).

Pipeline position: shared by the profiler (``ModelProfile.signature()`` is built
from the same rule) and by ``apply`` (which checks a plan against the model it
is asked to wrap). Works on any Keras 3 model object; imports nothing heavy.

The rule: the layers of ``model.layers`` in order, without ``InputLayer``s,
with every nested ``keras.Model`` replaced by its own layers (recursively),
named ``outer/inner`` (``/`` joins the nested model's name and the layer's).
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


def profiled_layer_paths(model: Any) -> list[tuple[str, Any]]:
    """(qualified name, layer) for each layer a profile and a plan talk about, in order.

    Keras 3 ``model.layers`` is a topological order for Functional models and the
    call order for Sequential ones (attribute order for subclassed models); a
    nested model's layers take its place in that order.
    """
    import keras

    paths: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(container: Any, prefix: str) -> None:
        for layer in container.layers:
            if id(layer) in seen or type(layer).__name__ == "InputLayer":
                continue
            seen.add(id(layer))
            if isinstance(layer, keras.Model):
                visit(layer, f"{prefix}{layer.name}{SEPARATOR}")
            else:
                paths.append((prefix + layer.name, layer))

    visit(model, "")
    return paths


def profiled_layers(model: Any) -> list[Any]:
    """The layer objects of ``profiled_layer_paths``, in the same order."""
    return [layer for _, layer in profiled_layer_paths(model)]


def model_signature(model: Any) -> tuple[tuple[str, str, int], ...]:
    """(qualified name, class name, count_params()) for each profiled layer, in order."""
    return tuple((name, type(layer).__name__, int(layer.count_params()))
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
