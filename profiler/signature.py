"""A model's identity as a plan sees it: (layer name, layer type, parameter count).

Pipeline position: shared by the profiler (``ModelProfile.signature()`` is built
from the same rule) and by ``apply`` (which checks a plan against the model it
is asked to wrap). Works on any Keras 3 model object; imports nothing heavy.
"""
from __future__ import annotations

from typing import Any


def profiled_layers(model: Any) -> list[Any]:
    """The layers a profile and a plan talk about, in the model's own order.

    Keras 3 ``model.layers`` is a topological order for Functional models and the
    call order for Sequential ones; ``InputLayer`` holds no work and is skipped.
    """
    return [layer for layer in model.layers if type(layer).__name__ != "InputLayer"]


def model_signature(model: Any) -> tuple[tuple[str, str, int], ...]:
    """(name, class name, count_params()) for each profiled layer, in order."""
    return tuple((layer.name, type(layer).__name__, int(layer.count_params()))
                 for layer in profiled_layers(model))
