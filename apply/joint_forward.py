"""A train step's forward pass over all its parts at once, layer by layer: what
``global`` batch statistics need (``apply.batch_stats``).

Pipeline position: ``apply.planned_model``'s train step calls ``joint_forward`` instead
of one forward per micro-batch (and per replica copy, ``apply.tensor_parallel``) when
the plan's batch statistics are ``global`` and the model has BatchNormalization layers.

The step's parts are its micro-batches, each cut into one piece per replica copy of the
model (``models``: the wrapped model and its other data-parallel copies, same layers and
names). Keras' Functional graph is walked once (``compat.run_graph``) with every tensor
standing for all parts (``Parts``); each operation is called once per part, through the
owning copy's own per-operation wrapper (``PlannedModel.wrap_operation``: its device,
recomputation), so every op lands where the per-part forward would put it. A
BatchNormalization operation first computes the moments over all parts
(``batch_stats.global_moments``, on each part's device) and hands them to each copy of
the layer. Only the graph's data flow orders the ops, so parts run in parallel wherever
no BatchNormalization joins them.
"""
from __future__ import annotations

from typing import Any, Sequence

import keras

from tfplan import compat
from tfplan.apply.batch_stats import StepStats, global_moments


class Parts:
    """One value per part (a leaf for ``keras.tree``: not a sequence type)."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)


def _part(structure: Any, p: int) -> Any:
    return keras.tree.map_structure(
        lambda v: v.values[p] if isinstance(v, Parts) else v, structure)


def joint_forward(models: Sequence[Any], parts: Sequence[tuple[int, Any]],
                  stats: StepStats) -> list[Any]:
    """The outputs of ``models[r](x, training=True)`` for each ``(r, x)`` of ``parts``,
    computed layer by layer with global batch statistics (module docstring)."""
    base = models[0]
    flat = [compat.standardize_functional_inputs(models[r], x) for r, x in parts]
    inputs = [Parts([f[j] for f in flat]) for j in range(len(flat[0]))]
    owners = [r for r, _ in parts]
    by_name = [{op.name: op for op in m.operations} for m in models]

    def operation_fn(op: Any) -> Any:
        copies = [names[op.name] for names in by_name]
        calls = [m.wrap_operation(c, compat.functional_operation(c, training=True))
                 for m, c in zip(models, copies)]
        normalises = isinstance(op, keras.layers.BatchNormalization) and op.trainable

        def run(*args: Any, **kwargs: Any) -> Any:
            if normalises:
                x = args[0] if args else kwargs["inputs"]
                devices = [models[r].operation_device(copies[r]) for r in owners]
                mean, variance = global_moments(op, x.values, devices)
                for c in copies:
                    stats.give(c, mean, variance)
            outputs = [calls[r](*_part(args, p), **_part(kwargs, p))
                       for p, r in enumerate(owners)]
            return keras.tree.map_structure(lambda *vs: Parts(vs), *outputs)

        return run

    out = compat.run_graph(base, inputs, operation_fn)
    out = compat.unpack_singleton(out)
    return [_part(out, p) for p in range(len(parts))]
