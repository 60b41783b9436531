"""apply: turns a Plan and a Keras model into a model that trains with the plan.

Pipeline position: third stage, in the user's training script, after
``planner.load_plan``. ``ensure_devices(plan)`` makes the plan's devices exist
(call it before building the model); ``wrap(model, plan)`` returns the
keras.Model to compile and fit; ``variable_devices(model)`` says where each
variable and optimizer slot lives. ``auto(model, global_batch)`` plans for this
process's devices and wraps in one call (``apply.auto``; ``PLAN_FILE`` loads a
plan instead; ``auto_devices()`` before building the model makes its devices).
How a plan runs is decided once (``apply.mode.execution_mode``).
Modes: single device and pipeline (``apply.pipeline``), data parallel
(``apply.data_parallel``), tensor parallel and one-host hybrids
(``apply.tensor_parallel``; ZeRO-1 and -2 in ``apply.zero``, ZeRO-3 in ``apply.zero3``),
and the SPMD engine (``apply.spmd``), which runs every plan it accepts, on one host and
across worker processes, one program per worker (``plan launch`` starts the workers).
Importing ``apply`` imports TensorFlow and Keras (and
registers the wrapped model classes, so ``keras.models.load_model`` can read
files a wrapped model saved).
"""
from __future__ import annotations

# imported to register the wrapped model classes with Keras
from tfplan.apply import data_parallel, pipeline, tensor_parallel  # noqa: F401
from tfplan.apply import legacy_names  # noqa: F401  (0.1's names: a clear error)
from tfplan.apply.auto import auto, auto_devices
from tfplan.apply.devices import ensure_devices
from tfplan.apply.placement import variable_devices
from tfplan.apply.wrap import wrap

__all__ = ["auto", "auto_devices", "ensure_devices", "variable_devices", "wrap"]
