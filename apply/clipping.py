"""``global_clipnorm`` when the optimizer updates several copies of each weight.

Pipeline position: inside the update of the replicated modes (``apply.tensor_parallel``
with dp > 1 on one host): their
optimizer updates every data-parallel copy of a weight with the same
summed gradient, so Keras' ``clip_by_global_norm`` over all it is given would see each
gradient dp times, a norm sqrt(dp) too large, and clip more than one device does.

``clipped_over_one_copy`` computes the global norm over one copy of each gradient (copy
0: ``gradients[:n]``), with Keras' own formula (``tfplan.compat.global_norm``, Keras'
``global_norm``, and the scale of ``clip_by_global_norm``: ``clip * min(1/norm, 1/clip)``,
NaN when the norm is not finite), scales every copy by it on its own device, and
``optimizer_clipping_off`` switches the optimizer's own global clipping off for that
update (a Python attribute, read when the step is traced). Under a
``LossScaleOptimizer`` the gradients are still scaled by its ``dynamic_scale``, so the
norm is divided by it first. ``clipnorm`` (per weight) and ``clipvalue`` need nothing:
each copy is clipped alike. ZeRO-1 (``apply.zero``) hands the optimizer one copy of
each weight, so Keras' clipping is already right there.

Under a tf.distribute strategy (``apply.data_parallel``: MirroredStrategy) Keras 3 clips each replica's own
gradient *before* its all-reduce (``BaseOptimizer.apply`` clips, then the TF backend's
``_backend_update_step`` sums across replicas), so each replica clips a part of the
gradient by that part's norm: not what one device does (checked with Keras 3.15).
``all_reduced_and_clipped`` sums the gradients across the replicas first (the same one
all-reduce Keras would make), clips the sum, and ``keras_all_reduce_off`` stops the
optimizer from summing them again for that update.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import tensorflow as tf

from tfplan import compat
from tfplan.apply.placement import inner_optimizer, tf_variable

_LOCK = threading.Lock()
_ACTIVE: dict[tuple[int, str], list[Any]] = {}  # (id(obj), name): [depth, had it, old value]


def _global_clipnorm(optimizer: Any) -> float | None:
    """The optimizer's ``global_clipnorm``, also while ``optimizer_clipping_off`` has it
    off for another replica's thread."""
    inner = inner_optimizer(optimizer)
    with _LOCK:
        entry = _ACTIVE.get((id(inner), "global_clipnorm"))
        clip = entry[2] if entry is not None else getattr(inner, "global_clipnorm", None)
    return float(clip) if clip and clip > 0 else None


def clipped_over_one_copy(optimizer: Any, gradients: Sequence[Any], variables: Sequence[Any],
                          copies: int, one_copy: Sequence[Any] | None = None) -> list[Any]:
    """``gradients`` (``copies`` blocks of n, block r for copy r of the n weights) scaled
    as ``global_clipnorm`` scales one copy's; unchanged without global clipping.
    ``one_copy``: the gradients that make one copy of the model when block 0 does not
    (expert shards spread over several replicas: ``apply.expert_parallel``)."""
    clip = _global_clipnorm(optimizer)
    if clip is None or copies <= 1:
        return list(gradients)
    n = len(gradients) // copies
    scale = _clip_scale(optimizer, gradients[:n] if one_copy is None else one_copy, clip)
    if scale is None:
        return list(gradients)
    out = []
    for g, v in zip(gradients, variables):
        if g is None:
            out.append(None)
            continue
        with tf.device(tf_variable(v).device):
            out.append(_scaled(g, scale))
    return out


def all_reduced_and_clipped(optimizer: Any, gradients: Sequence[Any]) -> list[Any]:
    """In a replica context: ``gradients`` summed over every replica (one all-reduce),
    then scaled as ``global_clipnorm`` scales that sum. Use with ``keras_all_reduce_off``
    and ``optimizer_clipping_off`` around the optimizer's update."""
    present = [g for g in gradients if g is not None]
    if not present:
        return list(gradients)
    reduced = iter(tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, present))
    summed = [None if g is None else next(reduced) for g in gradients]
    clip = _global_clipnorm(optimizer)
    scale = _clip_scale(optimizer, summed, clip) if clip is not None else None
    return summed if scale is None else [None if g is None else _scaled(g, scale)
                                         for g in summed]


def clips_globally(optimizer: Any) -> bool:
    """Whether the optimizer has a ``global_clipnorm`` (the cases this module handles)."""
    return _global_clipnorm(optimizer) is not None


@contextlib.contextmanager
def keras_all_reduce_off(optimizer: Any) -> Iterator[None]:
    """The optimizer does not sum the gradients across replicas inside (they are summed:
    ``all_reduced_and_clipped``). Overrides Keras 3's TF-backend
    ``TFOptimizer._all_reduce_sum_gradients`` (``compat.ALL_REDUCE_SUM_GRADIENTS``) on
    this optimizer object while the update is traced."""
    compat.check_all_reduce_sum_gradients(optimizer)
    with _overridden(inner_optimizer(optimizer), compat.ALL_REDUCE_SUM_GRADIENTS, _as_they_are):
        yield


@contextlib.contextmanager
def optimizer_clipping_off(optimizer: Any) -> Iterator[None]:
    """The optimizer's ``global_clipnorm`` off inside (the gradients are clipped)."""
    if _global_clipnorm(optimizer) is None:
        yield
        return
    with _overridden(inner_optimizer(optimizer), "global_clipnorm", None):
        yield


@contextlib.contextmanager
def _overridden(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name = value`` inside, restored after. A tf.distribute strategy traces each
    replica's step in its own thread, all entering this for the same optimizer: the
    first to enter sets the value, the last to leave restores it (under a lock). Set
    with ``object.__setattr__``: Keras' tracking ``__setattr__`` would wrap it."""
    key = (id(obj), name)
    with _LOCK:
        entry = _ACTIVE.get(key)
        if entry is None:
            had, old = name in vars(obj), vars(obj).get(name)
            entry = _ACTIVE[key] = [0, had, old]
            object.__setattr__(obj, name, value)
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _ACTIVE[key]
                if entry[1]:
                    object.__setattr__(obj, name, entry[2])
                else:
                    object.__delattr__(obj, name)


def _as_they_are(grads_and_vars: Any) -> list[Any]:
    return list(grads_and_vars)


def _clip_scale(optimizer: Any, gradients: Sequence[Any], clip: float) -> Any:
    """Keras' ``clip_by_global_norm`` factor for ``gradients`` (None if there are none)."""
    present = [_dense_values(g) for g in gradients if g is not None]
    if not present:
        return None
    norm = compat.global_norm(present)
    if inner_optimizer(optimizer) is not optimizer:  # LossScaleOptimizer: still scaled
        norm = norm / tf.cast(optimizer.dynamic_scale, norm.dtype)
    scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
    return scale + (norm - norm)  # NaN for a non-finite norm, as Keras


def _dense_values(g: Any) -> Any:
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _scaled(g: Any, scale: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices,
                                g.dense_shape)
    return g * tf.cast(scale, g.dtype)
