"""Keras layers the project ships for users' models (``tfplan.layers``).

Pipeline position: between ``tfplan.compat`` and ``tfplan.profiler``: a user's model
file uses them, the profiler recognises them, ``apply`` swaps them for their
parallel twins. They import Keras and TensorFlow, nothing above.

* ``MixtureOfExperts``: a routed mixture-of-experts feed-forward layer
  (``tfplan.layers.moe``).
"""
from __future__ import annotations

from tfplan.layers.moe import MixtureOfExperts

__all__ = ["MixtureOfExperts"]
