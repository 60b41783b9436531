"""apply: turns a Plan and a Keras model into a model that trains with the plan.

Pipeline position: third stage, in the user's training script, after
``planner.load_plan``. ``ensure_devices(plan)`` makes the plan's devices exist
(call it before building the model); ``wrap(model, plan)`` returns the
keras.Model to compile and fit; ``variable_devices(model)`` says where each
variable and optimizer slot lives. Modes: single device and pipeline
(``apply.pipeline``), data parallel (``apply.data_parallel``). Importing
``apply`` imports TensorFlow and Keras (and registers the wrapped model classes,
so ``keras.models.load_model`` can read files a wrapped model saved).
"""
from __future__ import annotations

from apply import data_parallel, pipeline  # noqa: F401  (register the model classes)
from apply.devices import ensure_devices
from apply.placement import variable_devices
from apply.wrap import wrap

__all__ = ["ensure_devices", "variable_devices", "wrap"]
