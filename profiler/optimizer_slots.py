"""How many state slots an optimizer keeps per trainable parameter.

Pipeline position: used by ``profiler.static`` to fill ``LayerProfile.optimizer_bytes``
and ``ModelProfile.optimizer_slots_per_param``, which the planner's memory model
reads. Works on an optimizer name (``"adam"``), a Keras optimizer object
(``LossScaleOptimizer`` is unwrapped) or a no-argument factory returning one.

Slots per parameter (from each Keras 3 optimizer's ``build``): SGD 0 (1 with
momentum), Adam/AdamW 2 (3 with amsgrad), Adamax 2, Nadam 2, RMSprop 1 (+1 with
momentum, +1 if centered), Adagrad 1, Adadelta 2, Ftrl 2, Lion 1. Anything else
counts as 2 with a warning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_BASE_SLOTS = {"sgd": 0, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "rmsprop": 1,
               "adagrad": 1, "adadelta": 2, "ftrl": 2, "lion": 1}
UNKNOWN_SLOTS = 2
DEFAULT_OPTIMIZER = "adam"


@dataclass(frozen=True)
class OptimizerSlots:
    """An optimizer's canonical name, its slots per parameter, and a warning if guessed."""

    name: str
    slots_per_param: int
    warning: str | None = None


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "")


def optimizer_slots(optimizer: Any) -> OptimizerSlots:
    """Slots per parameter for ``optimizer`` (a name, a Keras optimizer, or a factory)."""
    if isinstance(optimizer, str):
        name = _canonical(optimizer)
        if name in _BASE_SLOTS:  # names use Keras defaults: no momentum, not centered
            return OptimizerSlots(name, _BASE_SLOTS[name])
        return _unknown(optimizer)
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if inner is not None:
        return optimizer_slots(inner)
    if not hasattr(optimizer, "learning_rate") and callable(optimizer):
        try:
            made = optimizer()
        except Exception as exc:  # a factory we cannot call: say so, assume the default
            return OptimizerSlots(DEFAULT_OPTIMIZER, _BASE_SLOTS[DEFAULT_OPTIMIZER],
                                  f"calling optimizer factory {optimizer!r} raised "
                                  f"{type(exc).__name__}: {exc}; assuming {DEFAULT_OPTIMIZER}")
        return optimizer_slots(made)
    name = _canonical(type(optimizer).__name__)
    if name not in _BASE_SLOTS:
        return _unknown(type(optimizer).__name__)
    slots = _BASE_SLOTS[name]
    if name == "sgd" and float(_value(getattr(optimizer, "momentum", 0.0))) > 0:
        slots += 1
    if name == "rmsprop":
        slots += int(float(_value(getattr(optimizer, "momentum", 0.0))) > 0)
        slots += int(bool(getattr(optimizer, "centered", False)))
    if name in ("adam", "adamw") and getattr(optimizer, "amsgrad", False):
        slots += 1
    return OptimizerSlots(name, slots)


def _value(x: Any) -> Any:
    return x.numpy() if hasattr(x, "numpy") else x


def _unknown(name: str) -> OptimizerSlots:
    return OptimizerSlots(
        _canonical(name), UNKNOWN_SLOTS,
        f"optimizer '{name}' is not one the profiler knows (expected one of "
        f"{', '.join(sorted(_BASE_SLOTS))}); assuming {UNKNOWN_SLOTS} state slots per "
        "parameter, as Adam keeps")
