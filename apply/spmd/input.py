"""A batch cut into the plan's parts, and a dataset cut so each worker reads only its rows.

Pipeline position: the first thing a step does (``SpmdModel._parts``: ``cut``), and,
one program per worker, what ``fit``, ``evaluate`` and ``predict`` do to a
``tf.data.Dataset`` before Keras iterates it (``worker_rows``).

``cut``: a global batch of n rows is cut into P = dp x m parts (x cp sequence chunks),
part q m + k (replica q's micro-batch k) holding rows ``bounds[i]:bounds[i+1]`` with
``bounds[i] = i n // (P / cp)`` of row group i = r m + k (q = r cp + c: context rank c
takes chunk c of the sequence, ``apply.spmd.context.chunk_of``). Under tensor or expert
parallelism, or hops between workers, a batch smaller than the plan's is first padded to
it (its padding rows flagged 0: ``fixed_batch``).

``worker_rows``: one program per worker, a worker trains only the parts of its columns
(``RunDescription.local_columns``). Each global batch of the dataset is cut as above inside
the input pipeline, on the worker's host, and the element the step receives holds only
this worker's parts (and n, the batch's rows): no other worker's rows reach this worker's
devices, and every global batch covers the same rows as on one device, so training equals
one device's (tf.distribute's ``AutoShardPolicy.DATA``, with its rows cut as the plan
cuts them rather than every W-th element). Each worker still reads every element from
the source (as ``DATA`` sharding does); sharding by file is not built (see the README).
A dataset whose ``options().experimental_distribute.auto_shard_policy`` is ``OFF`` is
left whole: each step then keeps its rows from the global batch, as arrays and
``train_on_batch`` do.
"""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfplan.apply.spmd.context import chunk_of
from tfplan.core.errors import PlannerError

KEY = "tfplan_worker_rows"  # the element a sharded dataset yields: {KEY: {...}}


def rows_of(structure: Any) -> Any:
    """The batch size of a (possibly nested) batch: its first tensor's leading dimension,
    an int where the traced shape knows it, else a scalar tensor."""
    first = next(t for t in tf.nest.flatten(structure) if t is not None)
    shape = tf.TensorShape(first.shape)  # a NumPy array's too (eager steps)
    static = shape[0] if shape.rank else None
    return tf.shape(first)[0] if static is None else static


def cut(data: Any, run: Any, sequence: int | None) -> tuple[list[Any], list[Any], Any]:
    """(parts, flags, n) of a global batch (module docstring): every part, in part order,
    its row flags (1 real, 0 padding; None where nothing is padded), and the batch's rows
    before padding (an int where static)."""
    n_parts = run.parts
    n = rows_of(data)  # static where known: every part's shape is then known
    real = n
    valid = None
    if run.fixed_batch and not (isinstance(n, int) and n == run.global_batch):
        data, valid = padded(data, n, run)
        n = run.global_batch
    cp = run.cp
    n_rows = n_parts // cp
    bounds = [(i * n) // n_rows for i in range(n_rows + 1)]
    rows = [tf.nest.map_structure(lambda t, lo=lo, hi=hi: None if t is None else t[lo:hi],
                                  data) for lo, hi in zip(bounds, bounds[1:])]
    flags = [None if valid is None else valid[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    if cp == 1:
        return rows, flags, real
    m = run.num_microbatches  # part q m + k: replica q = r cp + c, micro-batch k
    order = [(r, c, k) for r in range(n_rows // m) for c in range(cp) for k in range(m)]
    return ([chunk_of(rows[r * m + k], sequence, cp, c) for r, c, k in order],
            [flags[r * m + k] for r, _, k in order], real)


def padded(data: Any, n: Any, run: Any) -> tuple[Any, Any]:
    """``data`` (n rows, n <= the plan's global batch B) padded with zero rows to B rows, and
    the row flags (1 real, 0 padding). Under tensor parallelism the ranks all-reduce
    activations whose shape follows the batch, and TensorFlow's collective runtime keeps
    the first shape it saw for each instance of a traced step: every step's collectives
    must have the same shapes, so a smaller batch (a dataset's last) runs as a full one
    whose padding rows weigh 0. A larger batch is refused first, with the fix."""
    b = run.global_batch
    if isinstance(n, int):
        if n > b:
            raise PlannerError(batch_message(run, n))
    else:
        check = tf.debugging.assert_less_equal(n, tf.constant(b, n.dtype),
                                               message=batch_message(run, None))
        with tf.control_dependencies([check]):
            n = tf.identity(n)

    def pad(t: Any) -> Any:
        if t is None:
            return None
        rows = tf.pad(t, [[0, b - n]] + [[0, 0]] * (len(t.shape) - 1))
        return tf.ensure_shape(rows, [b, *t.shape[1:]])

    valid = tf.cast(tf.range(b) < n, "float32")
    return tf.nest.map_structure(pad, data), valid


def batch_message(run: Any, n: int | None) -> str:
    received = f"received {n} rows" if n is not None else "received a larger batch"
    why = ("tensor parallel" if run.tp > 1 else "expert parallel" if run.ep > 1
           else "pipeline stages across workers")  # collectives moving activations
    return (f"Plan {run.plan_name!r} runs {why} on the SPMD engine, which takes "
            f"batches of at most the plan's global batch ({run.global_batch} rows; smaller "
            f"ones are padded); {received}. Batch the data by {run.global_batch} "
            f"(batch_size={run.global_batch}) for fit, evaluate and predict.")


def local_parts(run: Any) -> tuple[int, ...]:
    """The parts this worker's columns train on: q m + k for every replica q one of whose
    columns it drives."""
    m = run.num_microbatches
    replicas = sorted({q for q, _ in run.local_columns})
    return tuple(q * m + k for q in replicas for k in range(m))


def shards(run: Any) -> bool:
    """Whether ``worker_rows`` cuts a dataset for this worker: one program per worker, and
    this worker trains on fewer than all of a batch's parts."""
    return not run.every_column_here and len(local_parts(run)) < run.parts


def worker_rows(dataset: tf.data.Dataset, run: Any, sequence: int | None,
                check: Callable[[Any], list[Any]] | None = None) -> tf.data.Dataset:
    """``dataset`` (global batches) as this worker's rows of each batch (module docstring);
    ``check``: the plan's input-shape assertions on a batch's inputs, run on the whole
    batch before it is cut. A dataset that ``shards`` does not apply to, or whose
    auto-shard policy is ``OFF``, comes back as it is."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if not shards(run) or policy == tf.data.experimental.AutoShardPolicy.OFF \
            or is_worker_rows(dataset.element_spec):  # cut already (fit's validation data)
        return dataset
    mine = local_parts(run)

    def rows(*element: Any) -> dict[str, Any]:
        data = element[0] if len(element) == 1 else element
        checks = check(_inputs(data)) if check is not None else []
        with tf.control_dependencies(checks):
            data = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), data)
        parts, flags, n = cut(data, run, sequence)
        out = {"n": tf.convert_to_tensor(n, tf.int32),
               "parts": tuple(parts[p] for p in mine)}
        if flags[0] is not None:
            out["flags"] = tuple(flags[p] for p in mine)
        return {KEY: out}

    return dataset.map(rows, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def is_worker_rows(data: Any) -> bool:
    """Whether a step's batch is a worker's rows (``worker_rows``)."""
    return isinstance(data, dict) and set(data) == {KEY}


def parts_of(data: Any, run: Any) -> tuple[list[Any], list[Any], Any]:
    """``cut``'s (parts, flags, n) from a worker's rows: another worker's parts None."""
    element = data[KEY]
    parts: list[Any] = [None] * run.parts
    flags: list[Any] = [None] * run.parts
    for i, p in enumerate(local_parts(run)):
        parts[p] = element["parts"][i]
        if "flags" in element:
            flags[p] = element["flags"][i]
    return parts, flags, element["n"]


def _inputs(data: Any) -> Any:
    import keras

    return keras.utils.unpack_x_y_sample_weight(data)[0]
