"""profiler: measures a Keras model layer by layer (params, bytes, FLOPs).

Pipeline position: first stage. ``load_model_source`` imports the user's model,
``profile_model`` turns it into a ``ModelProfile`` (see ``profiler.model_profile``,
which imports no TensorFlow). TensorFlow is imported lazily, on first use.
"""
from __future__ import annotations

from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile

__all__ = ["Edge", "LayerProfile", "ModelProfile", "load_model_source", "profile_model"]


def __getattr__(name: str):  # lazy: importing profiler must not import TensorFlow
    if name == "load_model_source":
        from tfplan.profiler.loader import load_model_source
        return load_model_source
    if name == "profile_model":
        from tfplan.profiler.static import profile_model
        return profile_model
    raise AttributeError(name)
