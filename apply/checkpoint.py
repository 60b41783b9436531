"""Plan-independent checkpoints: weight files whose optimizer state has one device's layout.

Pipeline position: under ``apply.planned_model`` (whose ``save_weights``, ``save`` and
``load_weights`` run through ``canonical_optimizer_io``); each mode says where the
user's weights live (``PlannedModel._checkpoint_layout``: one ``CanonicalWeight`` per
trainable weight of the user's model, in its order). Keras' ``BackupAndRestore``
writes its backups with ``model.save_weights``, so its backups move between plans too.

Keras 3 writes a model's optimizer into a weight file as a list of arrays
(``optimizer.save_own_variables``: ``iterations``, then the slots, in the order the
optimizer made them for the variables it was built on). That list differs by plan:
a MirroredStrategy optimizer has one slot per weight, a tensor-parallel one a slot
per shard of a split layer (and per data-parallel copy), a ZeRO-1 one slots on the
owner copies only. Here the list is always the one a plain optimizer of the same type
builds for the user's model on one device:

* slots of a split layer's shards are concatenated as its weights are (the axis its
  ``full_pieces`` names); of several data-parallel copies, the first copy that holds
  slots is written (the copies are equal after every step);
* loading splits each slot the same way and assigns it to every shard of every copy
  that the optimizer holds slots for (a ZeRO-1 owner, every replica otherwise);
  ``iterations`` and other variables that belong to no weight go by position.

Which slot belongs to which weight is read from a probe: an optimizer of the same
type and configuration, built inside a throw-away ``tf.Graph`` (no memory for its
variables) on variables of the same shapes, records the reference variable of each
slot it makes (``add_variable_from_reference``). Optimizers whose slot of a split
weight does not have the weight's shape (Adafactor's factored moments) cannot be
concatenated: a PlannerError says so.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.placement import inner_optimizer
from tfplan.core.atomic import fsync_file, replacing
from tfplan.core.errors import PlannerError

WEIGHTS_SUFFIX = ".weights.h5"


@dataclass(frozen=True)
class CanonicalWeight:
    """One trainable weight of the user's model as a wrapped model holds it.

    ``copies``: one entry per data-parallel copy the process holds (one for mirrored
    variables), each the weight's shard variables in order (one variable when unsplit).
    ``axis``: the axis the shards are concatenated along (None when unsplit).
    """

    copies: tuple[tuple[Any, ...], ...]
    axis: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shards = self.copies[0]
        shape = list(shards[0].shape)
        if self.axis is not None:
            shape[self.axis] = sum(int(v.shape[self.axis]) for v in shards)
        return tuple(int(d) for d in shape)

    @property
    def dtype(self) -> str:
        return tf.as_dtype(self.copies[0][0].dtype).name


def plain_layout(variables: Sequence[Any]) -> list[CanonicalWeight]:
    """Each variable is one weight, unsplit, one copy."""
    return [CanonicalWeight(((v,),)) for v in variables]


def merged_copies(layouts: Sequence[Sequence[CanonicalWeight]]) -> list[CanonicalWeight]:
    """The layouts of several data-parallel copies (same weights, same order) as one."""
    first = layouts[0]
    if any(len(other) != len(first) for other in layouts):
        raise PlannerError("The data-parallel copies of the model have different numbers of "
                           "trainable weights; keep their trainable flags equal.")
    return [CanonicalWeight(tuple(c for layout in layouts for c in layout[i].copies),
                            first[i].axis) for i in range(len(first))]


# --- which optimizer variable belongs to which weight ---------------------------------------

def slot_references(optimizer: Any, shapes: Sequence[tuple[tuple[int, ...], str, bool]]
                    ) -> list[tuple[int | None, int]]:
    """For an optimizer like ``optimizer`` built on variables of ``shapes`` ((shape, dtype,
    overwrite_with_gradient) each, in order): for each of its variables, in its order,
    (index of the variable it is a slot of, or None; how many slots of that variable came
    before it). Built in a throw-away graph: nothing is allocated."""
    references: list[tuple[int | None, int]] = []
    config = optimizer.get_config()  # eagerly: it reads the learning rate's value
    with tf.Graph().as_default():
        probe = type(optimizer).from_config(config)
        target = inner_optimizer(probe)
        probes = []
        for shape, dtype, overwrite in shapes:
            v = keras.Variable(initializer="zeros", shape=shape, dtype=dtype, trainable=True)
            if overwrite:
                v.overwrite_with_gradient = True
            probes.append(v)
        index_of = {id(v): i for i, v in enumerate(probes)}
        made: dict[int, int] = {}  # id(slot) -> reference index
        original = target.add_variable_from_reference

        def recorded(reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
            slot = original(reference_variable, *args, **kwargs)
            if id(reference_variable) in index_of:
                made[id(slot)] = index_of[id(reference_variable)]
            return slot

        target.add_variable_from_reference = recorded
        try:
            probe.build(probes)
        finally:
            del target.add_variable_from_reference
        counts: dict[int, int] = {}
        for v in probe.variables:
            ref = made.get(id(v))
            if ref is None:
                references.append((None, 0))
            else:
                references.append((ref, counts.get(ref, 0)))
                counts[ref] = counts.get(ref, 0) + 1
    return references


def slot_variables(optimizer: Any) -> dict[tuple[int, int], Any]:
    """{(id(variable), k): the k-th slot ``optimizer`` keeps for that variable}."""
    built = compat.optimizer_built_variables(optimizer)
    refs = slot_references(optimizer, [shape_key(v) for v in built])
    return {(id(built[ref]), k): v for v, (ref, k) in zip(optimizer.variables, refs)
            if ref is not None}


def shape_key(v: Any) -> tuple[tuple[int, ...], str, bool]:
    return (tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name,
            bool(getattr(v, "overwrite_with_gradient", False)))


class _Mapping:
    """Between a built optimizer's variables and the one-device list (see the docstring)."""

    def __init__(self, optimizer: Any, layout: Sequence[CanonicalWeight]) -> None:
        self.optimizer, self.layout = optimizer, list(layout)
        built = compat.optimizer_built_variables(optimizer)
        self.where: dict[int, tuple[int, int, int]] = {}  # id(var) -> (weight, copy, shard)
        for c, w in enumerate(self.layout):
            for r, shards in enumerate(w.copies):
                for s, v in enumerate(shards):
                    self.where[id(v)] = (c, r, s)
        missing = [v.path for v in built if id(v) not in self.where]
        if missing:
            raise PlannerError(
                f"The optimizer holds state for variable(s) {missing[:3]} that are not "
                "weights of the wrapped model; compile the wrapped model with a new optimizer "
                "(or its name) before saving or loading weights.")
        self.actual = [(None if ref is None else self.where[id(built[ref])], k)
                       for ref, k in slot_references(optimizer, [shape_key(v) for v in built])]
        canonical = slot_references(optimizer, [
            (w.shape, w.dtype, shape_key(w.copies[0][0])[2]) for w in self.layout])
        self.canonical_index: dict[tuple[int, int], int] = {}
        self.globals: list[int] = []
        for j, (ref, k) in enumerate(canonical):
            if ref is None:
                self.globals.append(j)
            else:
                self.canonical_index[(ref, k)] = j
        self.size = len(canonical)
        if sum(1 for ref, _ in self.actual if ref is None) != len(self.globals):
            raise PlannerError(
                f"Optimizer {optimizer.name!r} ({type(optimizer).__name__}) has a different "
                "number of variables that belong to no weight than one built on one device; "
                "its state cannot be written in the one-device layout.")

    def values(self, extra: dict[tuple[int, int], np.ndarray] | None = None
               ) -> list[np.ndarray]:
        """The optimizer's state as one device's optimizer would hold it. ``extra``:
        {(id(variable), k): its k-th slot's value} for slots this process does not hold."""
        variables = self.optimizer.variables
        pieces: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # (weight, k): {shard: }
        globals_ = []
        for v, (where, k) in zip(variables, self.actual):
            if where is None:
                globals_.append(np.asarray(v.numpy()))
                continue
            c, _, s = where  # the copies are equal: the first one found serves
            pieces.setdefault((c, k), {}).setdefault(s, np.asarray(v.numpy()))
        for (key, k), value in (extra or {}).items():
            if key in self.where:
                c, _, s = self.where[key]
                pieces.setdefault((c, k), {}).setdefault(s, np.asarray(value))
        out: list[np.ndarray | None] = [None] * self.size
        for j, value in zip(self.globals, globals_):
            out[j] = value
        for (c, k), j in self.canonical_index.items():
            w = self.layout[c]
            n = len(w.copies[0])
            found = pieces.get((c, k), {})
            if len(found) != n:
                raise PlannerError(
                    f"This process holds no optimizer state for weight "
                    f"{w.copies[0][0].path!r} (slot {k}) in any copy; every copy's state "
                    "is kept on another process.")
            parts = [found[s] for s in range(n)]
            value = parts[0] if w.axis is None else np.concatenate(parts, axis=w.axis)
            if tuple(value.shape) != w.shape and w.axis is not None:
                raise PlannerError(
                    f"Optimizer {self.optimizer.name!r} keeps slots of another shape than "
                    f"their weight ({w.copies[0][0].path!r}: {value.shape} vs {w.shape}); "
                    "slots of a split weight cannot be joined. Use an optimizer with "
                    "per-element state (SGD, Adam, AdamW, RMSprop, ...).")
            out[j] = value
        return [v for v in out if v is not None]

    def assign(self, values: Sequence[np.ndarray]) -> None:
        """Load the one-device list ``values`` into every shard and copy that has slots."""
        globals_ = iter([values[j] for j in self.globals])
        for v, (where, k) in zip(self.optimizer.variables, self.actual):
            if where is None:
                v.assign(next(globals_))
                continue
            c, _, s = where
            w = self.layout[c]
            value = np.asarray(values[self.canonical_index[(c, k)]])
            if w.axis is not None:
                shards = w.copies[0]
                sizes = [int(x.shape[w.axis]) for x in shards]
                value = np.split(value, np.cumsum(sizes)[:-1], axis=w.axis)[s]
            v.assign(value)


class _CanonicalOptimizerIO:
    """``save_own_variables``/``load_own_variables`` for one optimizer, in the one-device
    layout (installed on the optimizer instance while a file is written or read)."""

    def __init__(self, optimizer: Any, layout: Callable[[], Sequence[CanonicalWeight]],
                 extra: Callable[[], dict[tuple[int, int], np.ndarray]] | None = None
                 ) -> None:
        self.optimizer, self.layout, self.extra = optimizer, layout, extra
        self.original_save = optimizer.save_own_variables
        self.original_load = optimizer.load_own_variables

    def _mapping(self) -> _Mapping | None:
        if not self.optimizer.built:
            return None  # nothing but iterations (and the learning rate): Keras' own list
        return _Mapping(self.optimizer, self.layout())

    def save(self, store: Any) -> None:
        mapping = self._mapping()
        if mapping is None:
            self.original_save(store)
            return
        extra = self.extra() if self.extra is not None else None
        for i, value in enumerate(mapping.values(extra)):
            store[str(i)] = value

    def load(self, store: Any) -> None:
        mapping = self._mapping()
        if mapping is None or len(store.keys()) != mapping.size:
            self.original_load(store)  # Keras' own: warns and skips on a count mismatch
            return
        mapping.assign([store[str(i)] for i in range(mapping.size)])


@contextlib.contextmanager
def canonical_optimizer_io(optimizer: Any, layout: Callable[[], Sequence[CanonicalWeight]],
                           extra: Callable[[], dict[tuple[int, int], np.ndarray]] | None = None
                           ) -> Iterator[None]:
    """While it is open, Keras writes and reads ``optimizer``'s state in one device's
    layout (``layout()``: the model's ``CanonicalWeight`` list; ``extra()``: slots kept
    by other processes, see ``_Mapping.values``). No-op without an optimizer."""
    if optimizer is None:
        yield
        return
    io = _CanonicalOptimizerIO(optimizer, layout, extra)
    optimizer.save_own_variables = io.save
    optimizer.load_own_variables = io.load
    try:
        yield
    finally:
        del optimizer.save_own_variables  # back to the class's methods
        del optimizer.load_own_variables


def save_atomically(save: Callable[[str], None], filepath: Any) -> None:
    """``save(path)`` into a temporary ``*.weights.h5`` beside ``filepath``, then rename it
    over ``filepath``: a backup killed half-written leaves the previous one whole.
    Paths that are not local ``.weights.h5`` files are written in place."""
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    if path is None or not path.endswith(WEIGHTS_SUFFIX) or "://" in path:
        save(filepath)
        return
    with replacing(path) as tmp:  # tfplan.core.atomic: rename over it, or remove it
        save(tmp)
        fsync_file(tmp)

