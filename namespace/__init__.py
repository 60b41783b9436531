"""tfplan: profile a Keras model, plan how to split its training, apply the plan.

The pipeline, bottom layer first (a module imports only what stands below it;
import-linter contracts in ``pyproject.toml`` hold this and the tests run them):

* ``tfplan.core``: the shared vocabulary -- typed errors, schema versions, display
  units, the cluster types and presets. No TensorFlow.
* ``tfplan.compat``: every private Keras/TensorFlow API the project relies on, each
  named with the versions it was checked on.
* ``tfplan.profiler``: the model, layer by layer (``ModelProfile``).
* ``tfplan.planner``: ``ModelProfile`` + ``ClusterSpec`` -> ranked ``Plan``\\ s. No
  TensorFlow.
* ``tfplan.apply``: a ``Plan`` + a Keras model -> a model that trains with it.
* ``tfplan.reports`` and ``tfplan.cli`` (the ``plan`` command) on top.

Importing ``tfplan`` imports none of them.
"""
from __future__ import annotations

__version__ = "0.2.0"
