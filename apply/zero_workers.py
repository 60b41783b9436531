"""ZeRO-1 and ZeRO-2 across worker processes: each weight's optimizer state (and, stage 2,
its accumulated gradient) on one replica of the job.

Pipeline position: ``apply.multi_worker_hybrid`` uses it for a plan with
``strategy.optimizer_sharding`` whose data-parallel replicas are spread over worker
processes (``apply.wrap`` routes plain multi-worker data parallelism with ZeRO-1 there
too). ``apply.zero`` is the one-process version.

* Owners: the replicas of the job are numbered ``w * local_dp + r`` (worker w's local
  replica r); ``planner.zero.owners_by_device_group`` picks each weight group's owner
  among them (largest weights first onto the least-loaded replica, per stage and tensor
  rank), from the weights' sizes and devices only, so every worker computes the same
  owners without talking.
* Slots: each worker builds its optimizer on the copies it owns only; the job holds one
  copy of the optimizer state in all (each worker about 1/W of it).
* Step: the gradients are summed over the local replicas and all-reduced across the
  workers as without ZeRO (``MultiWorkerHybridModel._apply_gradients``), so every
  worker holds every weight's summed gradient; each worker updates the weights it owns
  (its optimizer, on each owner copy's device), copies the new values to its other
  local replicas, then one ``all_gather`` per dtype (inside
  ``MultiWorkerMirroredStrategy.run``) hands each worker's updated weights, flattened
  and padded to the longest worker's share, to every other worker, which assigns them
  to its copies. The copies stay equal and the losses are one device's.
* Cost: the all-reduce of the gradients plus the all-gather of the weights move about
  1.5x the bytes of plain data parallelism's all-reduce (ZeRO's reduce-scatter would
  make it 1x: ``tf.distribute`` offers no reduce-scatter). Memory is what ZeRO-1
  promises: optimizer state /W per worker (per replica, with local replicas).
* ZeRO-2 (``reduce_to_owner_workers``): with several micro-batches, each micro-batch's
  gradients are summed over the local replicas and all-reduced across the workers at
  once, and each worker keeps only the sums of the weights it owns (at the owner
  copy's position, on its device), accumulating those alone: the accumulated
  gradients are sharded over the job (about 1/W per worker) where ZeRO-1 keeps a
  full accumulated gradient on every local replica. The substitute for ZeRO's
  reduce-scatter is the all-reduce: TensorFlow's CPU collectives have no
  reduce-scatter (``CollectiveReduceScatterV2`` has no CPU implementation that runs
  here), so every worker receives every sum for an instant and drops those it does
  not own: 2x the reduce-scatter's bytes per micro-batch, and m all-reduces per step
  instead of ZeRO-1's one (m = ``num_microbatches``). With one micro-batch, stage 2
  is stage 1 (the all-reduce's non-owned sums are dropped after it as well).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfplan.apply.checkpoint import slot_variables, slots_per_variable
from tfplan.apply.device_names import short_name
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.placement import tf_variable
from tfplan.apply.zero import assign_copies
from tfplan.core.errors import PlannerError
from tfplan.planner.zero import owners_by_device_group


@dataclass(frozen=True)
class JobWeight:
    """One trainable weight: this worker's local copies and its owner in the job."""

    index: int  # position in each local replica's trainable variables
    copies: tuple[Any, ...]  # local replica r's keras.Variable at position r
    owner_worker: int
    owner_replica: int  # local replica index on the owner worker
    shape: tuple[int, ...]
    dtype: str
    count: int  # elements

    @property
    def owner_copy(self) -> Any:
        return self.copies[self.owner_replica]


def job_weights(variables: Sequence[Any], local_dp: int, num_workers: int) -> list[JobWeight]:
    """Group ``variables`` (local replica 0's trainable variables, then replica 1's, ...)
    into weights with their owner among the job's ``num_workers * local_dp`` replicas."""
    variables = list(variables)
    if local_dp < 1 or len(variables) % local_dp:
        raise PlannerError(f"ZeRO-1 needs the same trainable variables in each of the "
                           f"{local_dp} local replicas; received {len(variables)} in all.")
    n = len(variables) // local_dp
    copies = [tuple(variables[r * n + i] for r in range(local_dp)) for i in range(n)]
    groups = []
    for group in copies:
        local = [short_name(tf_variable(v).device) for v in group]
        devices = tuple(f"/job:worker/task:{w}{d}" for w in range(num_workers) for d in local)
        groups.append((devices, _count(group[0]) * tf.as_dtype(group[0].dtype).size))
    owners = owners_by_device_group(groups)
    return [JobWeight(index=i, copies=copies[i], owner_worker=owners[i] // local_dp,
                      owner_replica=owners[i] % local_dp, shape=tuple(copies[i][0].shape),
                      dtype=tf.as_dtype(copies[i][0].dtype).name, count=_count(copies[i][0]))
            for i in range(n)]


def owned_copies(weights: Sequence[JobWeight], task: int) -> list[Any]:
    """The copies worker ``task`` updates (and builds optimizer slots for)."""
    return [w.owner_copy for w in weights if w.owner_worker == task]


def apply_job_sharded(apply: Callable[[list[Any], list[Any]], None], optimizer: Any,
                      gradients: Sequence[Any], weights: Sequence[JobWeight], task: int,
                      num_workers: int, strategy: Any) -> None:
    """One ZeRO-1 update on worker ``task`` (see the module docstring).

    ``gradients``: the summed gradients in the layout of ``job_weights``' variables;
    ``apply(gradients, variables)``: the model's placed update.
    """
    n = len(weights)
    mine = [w for w in weights if w.owner_worker == task]
    pairs = [(gradients[w.owner_replica * n + w.index], w.owner_copy) for w in mine]
    pairs = [(g, v) for g, v in pairs if g is not None]
    if pairs:
        apply([g for g, _ in pairs], [v for _, v in pairs])
    else:  # owns nothing: keep the step count equal on every worker
        optimizer.iterations.assign_add(1)
    for w in mine:  # this worker's other replicas
        _assign_copies(w, _read(w.owner_copy), skip=w.owner_replica)
    if num_workers == 1:
        return
    shares = _shares(weights, num_workers)
    gathered = strategy.run(lambda: _gather(weights, task, shares))
    gathered = strategy.experimental_local_results(gathered)[0]
    for dtype, per_worker in shares.items():
        longest = max(sum(w.count for w in ws) for ws in per_worker)
        for worker, ws in enumerate(per_worker):
            if worker == task or not ws:
                continue
            start = worker * longest
            for w in ws:
                value = tf.reshape(gathered[dtype][start:start + w.count], w.shape)
                _assign_copies(w, value, skip=None)
                start += w.count


def reduce_to_owner_workers(gradients: Sequence[Any], weights: Sequence[JobWeight],
                            task: int) -> list[Any]:
    """ZeRO-2, in the replica context of worker ``task``: one micro-batch's ``gradients``
    (``job_weights``' layout) summed over the local replicas (on local replica 0's copy's
    device), all-reduced across the workers, and kept only for the weights this worker
    owns, at the owner copy's position and on its device; None everywhere else."""
    n = len(weights)
    local_dp = len(gradients) // n if n else 1
    sums: list[Any] = []
    for w in weights:
        parts = [gradients[r * n + w.index] for r in range(local_dp)]
        if any(p is None for p in parts):
            sums.append(None)
            continue
        with tf.device(tf_variable(w.copies[0]).device):
            sums.append(sum_gradients(parts))
    present = [s for s in sums if s is not None]
    reduced = iter(tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, present) if present else [])
    out: list[Any] = [None] * len(gradients)
    for w, s in zip(weights, sums):
        if s is None:
            continue
        total = next(reduced)
        if w.owner_worker == task:  # the others drop it here (no reduce-scatter: docstring)
            with tf.device(tf_variable(w.owner_copy).device):
                out[w.owner_replica * n + w.index] = (
                    total if isinstance(total, tf.IndexedSlices) else tf.identity(total))
    return out


def gather_slots(optimizer: Any, weights: Sequence[JobWeight], task: int, num_workers: int,
                 strategy: Any) -> dict[tuple[int, int], np.ndarray]:
    """Every worker's optimizer slots, on every worker (a collective: call it on all):
    {(id(owner copy), k): the k-th slot's value} for the weights other workers own, so
    the chief can write the whole optimizer state (``apply.checkpoint``). One
    ``all_gather`` per dtype, each worker's slots flattened and padded as in the update."""
    if num_workers == 1 or not weights:
        return {}
    counts = slots_per_variable(optimizer, [w.owner_copy for w in weights])
    mine = slot_variables(optimizer)
    shares: dict[str, list[list[tuple[JobWeight, int]]]] = {}
    for w, n in zip(weights, counts):
        for k in range(n):
            shares.setdefault(w.dtype, [[] for _ in range(num_workers)])[w.owner_worker].append(
                (w, k))
    shares = dict(sorted(shares.items()))
    longest = {dtype: max(sum(w.count for w, _ in ws) for ws in per_worker)
               for dtype, per_worker in shares.items()}

    def local() -> dict[str, Any]:
        ctx = tf.distribute.get_replica_context()
        out = {}
        for dtype, per_worker in shares.items():
            parts = [tf.reshape(_read(mine[(id(w.owner_copy), k)]), [-1])
                     for w, k in per_worker[task]]
            flat = tf.concat(parts, 0) if parts else tf.zeros([0], dtype)
            size = sum(w.count for w, _ in per_worker[task])
            out[dtype] = ctx.all_gather(tf.pad(flat, [[0, longest[dtype] - size]]), axis=0)
        return out

    gathered = strategy.experimental_local_results(strategy.run(tf.function(local)))[0]
    found: dict[tuple[int, int], np.ndarray] = {}
    for dtype, per_worker in shares.items():
        values = np.asarray(gathered[dtype])
        for worker, ws in enumerate(per_worker):
            start = worker * longest[dtype]
            for w, k in ws:
                if worker != task:
                    found[(id(w.owner_copy), k)] = values[start:start + w.count].reshape(
                        w.shape)
                start += w.count
    return found


def _shares(weights: Sequence[JobWeight], num_workers: int
            ) -> dict[str, list[list[JobWeight]]]:
    """{dtype: [the weights worker w owns, in index order, for each w]}."""
    out: dict[str, list[list[JobWeight]]] = {}
    for w in weights:
        out.setdefault(w.dtype, [[] for _ in range(num_workers)])[w.owner_worker].append(w)
    return dict(sorted(out.items()))


def _gather(weights: Sequence[JobWeight], task: int,
            shares: dict[str, list[list[JobWeight]]]) -> dict[str, Any]:
    """In the replica context: every worker's owned weights, flattened per dtype."""
    ctx = tf.distribute.get_replica_context()
    out = {}
    for dtype, per_worker in shares.items():
        longest = max(sum(w.count for w in ws) for ws in per_worker)
        parts = [tf.reshape(_read(w.owner_copy), [-1]) for w in per_worker[task]]
        flat = tf.concat(parts, 0) if parts else tf.zeros([0], dtype)
        padded = tf.pad(flat, [[0, longest - sum(w.count for w in per_worker[task])]])
        out[dtype] = ctx.all_gather(padded, axis=0)
    return out


def _read(variable: Any) -> Any:
    v = tf_variable(variable)
    with tf.device(v.device):
        return v.read_value()


def _assign_copies(weight: JobWeight, value: Any, skip: int | None) -> None:
    assign_copies(weight.copies, value, skip)


def _count(variable: Any) -> int:
    count = 1
    for dim in variable.shape:
        count *= int(dim)
    return count
