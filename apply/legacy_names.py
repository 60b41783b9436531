"""The Keras names tf-parallel-planner 0.1 saved wrapped models under: a clear error.

Pipeline position: registered when ``tfplan.apply`` is imported, next to the wrapped
model classes. Since 0.2 those classes (``DataParallelModel``, ``MultiWorkerModel``,
``MultiWorkerHybridModel``, ``PlacedModel``, ``TensorParallelModel``) are registered
with Keras under the package ``tfplan`` (``"tfplan>PlacedModel"``); 0.1 registered
them under ``apply`` (``"apply>PlacedModel"``), and a ``.keras`` file saved by 0.1
names them so in its ``config.json``. Without the stubs below, ``load_model`` on such
a file would say only that Keras cannot find the class; with them it raises
``LegacyModelFileError``, which names the old and new names and the fix.
"""
from __future__ import annotations

from typing import Any

import keras

from tfplan.core.errors import PlannerError

PACKAGE = "tfplan"  # what the wrapped model classes are registered under
LEGACY_PACKAGE = "apply"  # what tf-parallel-planner 0.1 registered them under
WRAPPED_MODEL_CLASSES = ("DataParallelModel", "MultiWorkerModel", "MultiWorkerHybridModel",
                         "PlacedModel", "TensorParallelModel")


class LegacyModelFileError(PlannerError):
    """A ``.keras`` file saved by tf-parallel-planner 0.1 (its wrapped model classes
    under their old Keras names)."""


def legacy_name_message(class_name: str) -> str:
    """What ``LegacyModelFileError`` says for a file naming ``apply>{class_name}``."""
    old, new = f"{LEGACY_PACKAGE}>{class_name}", f"{PACKAGE}>{class_name}"
    return (
        f"This .keras file was saved by tf-parallel-planner 0.1: its model is registered as "
        f"{old!r}, and tf-parallel-planner 0.2 registers that class as {new!r}. Convert "
        f"the file: it is a zip archive; in its config.json replace every "
        f"'\"{LEGACY_PACKAGE}>' by '\"{PACKAGE}>' (e.g. {old!r} -> {new!r}) and zip it again; "
        f"or load it with tf-parallel-planner 0.1 and save it again with 0.2. It then loads "
        f"as a plain Functional model, as before.")


def _legacy_stub(class_name: str) -> type:
    """A class registered as ``apply>{class_name}`` whose ``from_config`` raises."""

    class Legacy:
        def get_config(self) -> dict[str, Any]:  # Keras registers only classes with one
            return {}

        @classmethod
        def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
            raise LegacyModelFileError(legacy_name_message(class_name))

    Legacy.__name__ = class_name
    Legacy.__qualname__ = f"legacy_{LEGACY_PACKAGE}_{class_name}"
    return keras.saving.register_keras_serializable(package=LEGACY_PACKAGE,
                                                    name=class_name)(Legacy)


LEGACY_STUBS = {name: _legacy_stub(name) for name in WRAPPED_MODEL_CLASSES}
