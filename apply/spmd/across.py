"""What one program per worker adds to the SPMD engine: the few values every worker needs whole.

Pipeline position: beside ``apply.spmd.model``. Across workers (a plan whose devices name
several ``/job:worker/task:w``; ``RunDescription.local`` lists this worker's), each worker's
program runs its own columns only (``RunDescription.drives``), and talks to the others
through the same collectives as inside a worker. Three things are not any one column's, so
the workers exchange them over the ``workers`` group (each worker's host CPU,
``RunDescription.workers``; one collective each, on the host):

* **Metrics and the logged loss**: each worker updates its metric variables with the parts
  of the replicas whose tensor rank 0 it runs; ``summed_over_workers`` then all-reduces each
  variable's change in the step and adds the sum to its value before the step, so every
  worker holds the whole batch's metrics (exact for Keras' metrics, whose states are sums:
  totals, counts, confusion counts).
* **Outputs** (``call``, ``predict``): each worker puts its replicas' rows in a zero batch of
  the whole batch's shape (``gathered_outputs``); their sum over the workers is every row.
* **Files and flags** (``WorkerHooks``): the chief (worker 0) writes weight files, every
  worker waits for it (``_sync_workers``: a barrier, one scalar all-reduce), and
  ``BackupAndRestore``'s preemption flag is any worker's (``_any_worker``).
* **Whole weights and optimizer state** (``get_weights``, ``save_weights``, backups): the
  pieces a worker does not hold (another worker's tensor or expert ranks, ZeRO shards) come
  from their owners through ``exchanged``: every worker lists the same pieces (owner,
  shape), the owner puts each one's value in a zero buffer, and one all-reduce (float64:
  exact for float32 values and integer counts) gives every worker every piece.

On one host (every column here) none of this runs: the model's own paths do it on the host.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import tensorflow as tf

from tfplan.apply.backup import OneProcessBackupHooks
from tfplan.apply.collective_ops import instance_scope, member_all_reduce
from tfplan.core.errors import PlannerError


def host(run: Any) -> str:
    """This worker's member of the ``workers`` group (its host CPU)."""
    from tfplan.apply.spmd.run import task_of

    task = task_of(next(iter(run.local)))
    return next(d for d in run.workers.devices if task_of(d) == task)


def _summed(values: list[Any], run: Any) -> list[Any]:
    """``values`` (on this worker's host) summed over the workers: one all-reduce of them
    packed as float64 (exact for the counts and sums metrics hold)."""
    device = host(run)
    with tf.device(device):
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float64), [-1]) for v in values], 0)
        total = member_all_reduce(flat, run.workers, device, "workers")
        sizes = [v.shape.num_elements() for v in values]
        if None in sizes:
            raise PlannerError("A metric's state has a shape known only as it runs; the "
                               "workers cannot sum it. Use metrics of fixed-shape state.")
        return [tf.cast(tf.reshape(piece, v.shape), v.dtype)
                for piece, v in zip(tf.split(total, sizes), values)]


@contextlib.contextmanager
def summed_over_workers(metrics: list[Any], run: Any) -> Iterator[None]:
    """The metric variables' changes made inside the block summed over the workers (module
    docstring)."""
    variables = [v for m in metrics for v in m.variables]
    if not variables:
        yield
        return
    device = host(run)
    with tf.device(device):
        before = [tf.identity(v.value) for v in variables]
    yield
    with tf.device(device):
        changes = [v.value - b for v, b in zip(variables, before)]
    for v, b, change in zip(variables, before, _summed(changes, run)):
        with tf.device(device):
            v.assign(b + change)


def gathered_outputs(results: list[list[Any]], n: Any, run: Any, specs: Any,
                     sequence: int | None = None) -> Any:
    """The model's outputs for the whole batch of ``n`` rows on every worker (module
    docstring): replica q's parts from the worker running its tensor rank 0 (and its last
    pipeline chunk). ``specs``: the model's output KerasTensors (the shapes of a worker's
    zero batch where it holds no outputs). Under context parallelism (``sequence``: the
    model's positions) part q m + k holds rows r m + k (q = r cp + c) and, of an output
    along the sequence, chunk c's positions (``apply.spmd.context.chunk_of``): each
    placed there; an output without the sequence axis from chunk 0 alone (as on one host,
    ``context.joined``)."""
    m, cp = run.num_microbatches, run.cp
    padded = run.global_batch if run.fixed_batch else n
    row_parts = run.parts // cp
    bounds = [(i * padded) // row_parts for i in range(row_parts + 1)]
    device = host(run)
    mine = [(q * m + k, p["y_pred"]) for q, row in enumerate(results) if row[0] is not None
            for k, p in enumerate(row[0])]
    # every tensor rank holds its replica's whole outputs: any of this worker's parts shows
    # their structure (a worker running no tensor rank 0 gives a zero batch)
    template = next((p["y_pred"] for row in results for parts in row if parts is not None
                     for p in parts), None)
    if template is None:  # no outputs here (the last pipeline chunks are another's)
        template = list(specs) if len(specs) > 1 else specs[0]
    leaves_of = [tf.nest.flatten(y) for _, y in mine]
    shapes = tf.nest.flatten(template)
    out = []
    with tf.device(device):
        for leaf, like in enumerate(shapes):
            # an output along the sequence: a part holds 1/cp of its positions
            along = cp > 1 and len(like.shape) > 1 and like.shape[1] is not None and (
                like.shape[1] * (cp if tf.is_tensor(like) else 1) == sequence)
            tail = tf.shape(like)[1:] if tf.is_tensor(like) else tf.constant(
                tuple(like.shape[1:]), tf.int32)
            if along and tf.is_tensor(like):
                tail = tf.concat([[sequence], tail[1:]], 0)
            rows = tf.concat([[padded], tail], 0)
            local = tf.zeros(rows, tf.float32)
            for (i, _), leaves in zip(mine, leaves_of):
                q, k = divmod(i, m)
                r, c = divmod(q, cp)
                if c and not along:  # the same for every chunk: chunk 0's
                    continue
                y = tf.cast(leaves[leaf], tf.float32)
                part = r * m + k  # its rows
                pad = [[bounds[part], padded - bounds[part + 1]]] + [[0, 0]] * (len(y.shape) - 1)
                if along:  # chunk c's positions
                    size = sequence // cp
                    pad[1] = [c * size, sequence - (c + 1) * size]
                local = local + tf.pad(y, pad)
            whole = _summed_dynamic(local, run)  # the same op on every worker
            out.append(tf.cast(whole, tf.as_dtype(like.dtype))[:n])
    return tf.nest.pack_sequence_as(template, out)


def exchanged(run: Any, entries: list[tuple[int, tuple[int, ...], Any]]) -> list[Any]:
    """Every entry's value on every worker (module docstring): ``entries`` lists (owner
    task, shape, ``value()``) in the same order on every worker; ``value()`` is called on
    the owner only. NumPy float64 arrays of the shapes."""
    import numpy as np

    from tfplan.apply.spmd.run import task_of

    mine = task_of(host(run))
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in entries]
    flat = np.zeros(sum(sizes), np.float64)
    at = 0
    for (owner, shape, value), size in zip(entries, sizes):
        if owner == mine:
            got = np.asarray(value(), np.float64)
            if got.shape != tuple(shape):
                raise PlannerError(f"A piece of the model's state has shape {got.shape} on "
                                   f"its worker; the other workers expect {tuple(shape)}.")
            flat[at:at + size] = got.reshape(-1)
        at += size
    if not sizes:
        return []
    device = host(run)
    with instance_scope("exchange"), tf.device(device):
        total = member_all_reduce(tf.constant(flat), run.workers, device, "workers").numpy()
    out, at = [], 0
    for (_, shape, _), size in zip(entries, sizes):
        out.append(total[at:at + size].reshape(shape))
        at += size
    return out


def _summed_dynamic(value: Any, run: Any) -> Any:
    """``value`` (float32, its shape perhaps known only as it runs) summed over the
    workers: one all-reduce, the same whatever this worker holds."""
    device = host(run)
    with tf.device(device):
        return member_all_reduce(value, run.workers, device, "workers")


class WorkerHooks(OneProcessBackupHooks):
    """``PlannedBackupAndRestore``'s hooks for a model whose run may span workers (module
    docstring): a barrier and an any-worker flag over the ``workers`` group; one process's
    where every column is here. The model provides ``run_description``."""

    @property
    def is_chief(self) -> bool:
        """Worker 0 (the one writing files); True on one host."""
        run = self.run_description
        return run.every_column_here or host(run) == run.workers.devices[0]

    def _sync_workers(self) -> None:
        if not self.run_description.every_column_here:
            self._worker_sum(0.0)

    def _any_worker(self, flag: bool) -> bool:
        if self.run_description.every_column_here:
            return bool(flag)
        return float(self._worker_sum(1.0 if flag else 0.0)) > 0

    def _worker_sum(self, value: float) -> Any:
        """``value`` summed over the workers (every worker calls it: a barrier)."""
        run = self.run_description
        function = getattr(self, "_worker_sum_function", None)
        if function is None:
            device = host(run)

            @tf.function(autograph=False)
            def function(x: Any) -> Any:
                with instance_scope("workers"), tf.device(device):
                    return member_all_reduce(x, run.workers, device, "workers")

            object.__setattr__(self, "_worker_sum_function", function)
        return function(tf.constant([value], tf.float64))[0]
