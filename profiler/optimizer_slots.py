"""The optimizer state Keras keeps for each trainable variable.

Pipeline position: used by ``profiler.static`` to fill ``LayerProfile.optimizer_bytes``
and ``ModelProfile.optimizer_slots_per_param``, which the planner's memory model
reads. Works on an optimizer name (``"adam"``), a Keras optimizer object
(``LossScaleOptimizer`` is unwrapped) or a no-argument factory returning one.

State per trainable variable of shape S (from each Keras 3.15 optimizer's
``build``; every slot has the variable's dtype unless said otherwise):

* full-size slots (prod(S) elements each): SGD 0 (1 with momentum), Adam/AdamW
  2 (3 with amsgrad), Adamax 2, Nadam 2, Lamb 2, RMSprop 1 (+1 with momentum,
  +1 if centered), Adagrad 1, Adadelta 2, Ftrl 2, Lion 1; Muon 1 (momentum)
  for 2-D variables and 2 (AdamW's) for the others -- Muon's
  ``exclude_layers``/``exclude_embeddings`` options, which send some 2-D
  variables to AdamW too, are not modelled;
* Adafactor: 1 full-size slot (``velocity``) plus, for variables of rank >= 2,
  the factored second moments ``r`` of shape S[:-1] and ``c`` of shape
  S[:-2] + S[-1:]; a variable of rank < 2 gets two int32 scalar placeholders
  instead (4 bytes each).

Not counted per layer: the optimizer-wide scalars every Keras optimizer keeps
(``iteration`` int64, ``learning_rate`` float32; Nadam's ``u_product``) --
16-20 bytes per model. An optimizer *name* outside this list is an error
(``PlannerError``, naming the known ones: Keras's ``optimizers.get`` refuses
it too); an optimizer *object* of another class (a custom optimizer) counts 2
full-size slots, with a warning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from tfplan.core.errors import PlannerError

_BASE_SLOTS = {"sgd": 0, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "lamb": 2,
               "rmsprop": 1, "adagrad": 1, "adadelta": 2, "ftrl": 2, "lion": 1, "muon": 1,
               "adafactor": 1}
UNKNOWN_SLOTS = 2
DEFAULT_OPTIMIZER = "adam"
INT32_BYTES = 4


def known_optimizers() -> tuple[str, ...]:
    """The optimizer names ``optimizer_slots`` accepts, sorted."""
    return tuple(sorted(_BASE_SLOTS))


def check_optimizer_name(name: str) -> str:
    """``name`` in canonical form; PlannerError if it names no known optimizer."""
    canonical = _canonical(name)
    if canonical not in _BASE_SLOTS:
        raise PlannerError(
            f"optimizer {name!r} is not one the profiler knows; expected one of "
            f"{', '.join(known_optimizers())} (e.g. --optimizer adam), or give the model "
            "file an optimizer object.")
    return canonical


@dataclass(frozen=True)
class OptimizerSlots:
    """An optimizer's canonical name, full-size slots per parameter, a warning if guessed."""

    name: str
    slots_per_param: int
    warning: str | None = None

    def state_bytes(self, shape: Sequence[int], dtype_bytes: int) -> int:
        """Bytes of the state kept for one trainable variable of ``shape``."""
        n = math.prod(int(d) for d in shape)
        if self.name == "adafactor":
            if len(shape) < 2:
                return n * dtype_bytes + 2 * INT32_BYTES
            rows = math.prod(int(d) for d in shape[:-1])
            cols = math.prod(int(d) for d in shape[:-2]) * int(shape[-1])
            return (n + rows + cols) * dtype_bytes
        if self.name == "muon" and len(shape) != 2:
            return 2 * n * dtype_bytes
        return self.slots_per_param * n * dtype_bytes


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "")


def optimizer_slots(optimizer: Any) -> OptimizerSlots:
    """The state rule for ``optimizer`` (a name, a Keras optimizer, or a factory)."""
    if isinstance(optimizer, str):  # names use Keras defaults: no momentum, not centered
        name = check_optimizer_name(optimizer)
        return OptimizerSlots(name, _BASE_SLOTS[name])
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
