"""Collectives over a plan's groups: TensorFlow's collective ops, one per member device.

Pipeline position: above ``apply.groups`` (whose ``Group`` gives each collective its
devices and ``group_key``), below the engine's steps; ``apply.audit`` counts what these
launch by their name scopes (``tfplan_<collective>_<kind>``), a CPU stand-in as the
collective it stands for.

Called inside a ``tf.function`` with one value per member, ``values[i]`` on
``group.devices[i]``; each member's op is placed on its device, and each returns every
member's result (a list in member order). Every op carries an ordering token per device
(a resource variable's handle: collectives of one device run in program order) and
``communication_hint`` by device type: ``"nccl"`` between GPUs, ``"ring"`` between CPUs.

Which op runs where (TensorFlow 2.21):

* ``all_reduce``: ``CollectiveReduceV2`` (merge Add, final Id) on CPUs and GPUs;
* ``all_gather``: ``CollectiveGatherV2`` on CPUs and GPUs (concatenation along axis 0);
* ``reduce_scatter``: ``CollectiveReduceScatterV2`` on GPUs; on CPUs, where it has no
  kernel ("did not find collective implementation"), a stand-in with the same results: an
  all-reduce, each member keeping its 1/n slice of axis 0. It moves 2 (n-1)/n N instead of
  (n-1)/n N; the audit counts it as the reduce-scatter it stands for;
* ``send`` / ``receive`` (a pipeline hop between workers): ``CollectiveBcastSendV2`` and
  ``CollectiveBcastRecvV2`` in the two devices' group, on CPUs and GPUs (bfloat16 moves
  as float32: the ops have no bfloat16 kernel; no ordering token: the ops take none);
* ``all_to_all``: ``CollectiveAllToAllV2`` on GPUs; on CPUs, where it has no kernel, a
  stand-in with the same results: an all-gather of every member's whole input, each
  member keeping the slices sent to it. It moves (n-1) N instead of (n-1)/n N; the audit
  counts it as the all-to-all it stands for.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, Sequence

from tfplan.apply.groups import Group

# No timeout on the collectives (timeout_seconds=0, tf.distribute's default): TensorFlow
# 2.21 serves a collective's timeout with a thread of its own that sleeps the whole timeout
# (BaseCollectiveExecutor::CompleteParamsAsync -> Env::SchedClosureAfter), so with one every
# collective a step launches leaves a thread behind for that long: thousands a minute, until
# creating a thread fails and the process aborts (measured: 200 steps of a 2-member
# all-reduce left 808 threads with a 600 s timeout, none without). A member that never
# arrives is caught by the trace-time checks (``instance_scope``, one group table).
TIMEOUT_S = 0.0
# instance keys per (group key, device): the n-th collective a device launches in a group
# has key n on every member, so members that trace their own programs (one per device,
# or one per worker) agree without talking, and a key is never reused for another shape
_instance_keys: dict[tuple[int, str], Any] = {}
_tokens: dict[str, Any] = {}
KEYS_PER_TRACE = 1 << 14  # instance keys one traced step may use per group and device
# what a traced program is: its traces are counted per kind, so every worker tracing the
# same steps of the same script gives each trace the same base (one program per worker:
# a worker that traced something else first must not shift the others' keys)
TRACE_KINDS = ("train", "test", "call", "check", "workers", "exchange", "other")
_traces: dict[str, Any] = {}
_scope: list[tuple[int, dict]] = []  # the innermost instance_scope: (base, its counters)


@contextlib.contextmanager
def instance_scope(kind: str = "other") -> Iterator[None]:
    """While a step is traced: instance keys counted afresh from a base of its own, so a
    trace that failed half-way (some devices' collectives made, others not) cannot leave
    the next trace's members with different keys (they would wait for each other for
    ever: ``TIMEOUT_S``). ``kind`` (one of ``TRACE_KINDS``): the n-th trace of a kind has
    the same base in every process."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"instance_scope received kind {kind!r}; expected one of "
                         f"{TRACE_KINDS}.")
    n = next(_traces.setdefault(kind, itertools.count(1)))
    _scope.append(((n * len(TRACE_KINDS) + TRACE_KINDS.index(kind)) * KEYS_PER_TRACE, {}))
    try:
        yield
    finally:
        _scope.pop()


def _token(device: str) -> Any:
    """The ordering token of ``device``: one resource variable per device, made once."""
    import tensorflow as tf

    if device not in _tokens:
        with tf.init_scope(), tf.device(device):
            _tokens[device] = tf.Variable(0.0, trainable=False, name="tfplan_ordering_token")
    return _tokens[device].handle


def _hint(device: str) -> str:
    import tensorflow as tf

    kind = (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()
    return "nccl" if kind == "GPU" else "ring"


def _check(values: Sequence[Any], group: Group) -> None:
    if len(values) != group.size:
        raise ValueError(f"A collective over the {group.kind} group {group.devices} received "
                         f"{len(values)} values; expected one per member ({group.size}).")


def _launch(name: str, op: Any, values: Sequence[Any], group: Group, kind: str | None,
            **attrs: Any) -> list[Any]:
    """``op`` (a ``tf.raw_ops`` collective) once per member under the name scope
    ``tfplan_<name>_<kind>`` (what ``apply.audit`` counts by), ``values[i]`` on
    ``group.devices[i]``, every member with the same instance key; the members' results."""
    _check(values, group)
    return [_member(name, op, value, group, device, kind, **attrs)
            for value, device in zip(values, group.devices)]


def _instance_key(group: Group, device: str) -> int:
    if _scope:
        base, counters = _scope[-1]
        return base + next(counters.setdefault((group.key, device), itertools.count(1)))
    counter = _instance_keys.setdefault((group.key, device), itertools.count(1))
    return next(counter)


def _member(name: str, op: Any, value: Any, group: Group, device: str, kind: str | None,
            **attrs: Any) -> Any:
    """One member's ``op`` on ``device`` (its instance key: ``_instance_key``)."""
    import tensorflow as tf

    if device not in group.devices:
        raise ValueError(f"Device {device!r} is not a member of the {group.kind} group "
                         f"{group.devices}.")
    with tf.name_scope(f"tfplan_{name}_{kind or group.kind}"), tf.device(device):
        return op(input=value, group_size=group.size, group_key=group.key,
                  instance_key=_instance_key(group, device), ordering_token=[_token(device)],
                  communication_hint=_hint(device), timeout_seconds=TIMEOUT_S, **attrs)


def member_all_reduce(value: Any, group: Group, device: str, kind: str | None = None) -> Any:
    """``device``'s part of an all-reduce over ``group`` (every member calls it, in the
    same order): the sum of every member's ``value``. For engines where each device's
    program is traced on its own (``apply.spmd``)."""
    import tensorflow as tf

    out = _member("all_reduce", tf.raw_ops.CollectiveReduceV2, value, group, device, kind,
                  merge_op="Add", final_op="Id")
    out.set_shape(value.shape)  # TensorFlow infers none: the layers after it, and the audit
    return out                  # sizing what they send on, see the input's


def _gathered_shape(value: Any, n: int) -> Any:
    """The static shape of ``n`` members' ``value`` concatenated along axis 0."""
    import tensorflow as tf

    shape = tf.TensorShape(value.shape)
    if shape.rank is None:
        return shape
    first = shape[0] * n if shape[0] is not None else None
    return tf.TensorShape([first, *shape[1:]])


def member_all_gather(value: Any, group: Group, device: str, kind: str | None = None) -> Any:
    """``device``'s part of an all-gather over ``group``: every member's ``value``
    concatenated along axis 0, in member order."""
    import tensorflow as tf

    if value.dtype != tf.bfloat16:
        out = _member("all_gather", tf.raw_ops.CollectiveGatherV2, value, group, device, kind)
        out.set_shape(_gathered_shape(value, group.size))
        return out
    # CollectiveGatherV2 has no bfloat16 kernel (TF 2.21): the same bytes gathered as int32
    # pairs (exact), or as float32 where a row holds an odd number of values
    with tf.device(device):
        shape = tf.shape(value)
        rows = tf.reshape(value, [shape[0], -1])
        width = rows.shape[1]
        if width is not None and width % 2 == 0:
            packed = tf.bitcast(tf.reshape(rows, [shape[0], width // 2, 2]), tf.int32)
            got = _member("all_gather", tf.raw_ops.CollectiveGatherV2, packed, group, device,
                          kind)
            with tf.device(device):
                flat = tf.reshape(tf.bitcast(got, tf.bfloat16), [-1, width])
        else:
            got = _member("all_gather", tf.raw_ops.CollectiveGatherV2,
                          tf.cast(rows, tf.float32), group, device, kind)
            with tf.device(device):
                flat = tf.cast(got, tf.bfloat16)
        return tf.reshape(flat, tf.concat([[-1], shape[1:]], 0))


def member_reduce_scatter(value: Any, group: Group, device: str, kind: str | None = None
                          ) -> Any:
    """``device``'s part of a reduce-scatter over ``group``: its slice (member i: slice i of
    n equal slices along axis 0, which must divide by n) of the sum of every member's
    ``value``. ``CollectiveReduceScatterV2`` between GPUs; between CPUs the stand-in
    (module docstring), under the name scope the audit counts as a reduce-scatter."""
    import tensorflow as tf

    if _hint(device) == "nccl":
        out = _member("reduce_scatter", tf.raw_ops.CollectiveReduceScatterV2, value, group,
                      device, kind, merge_op="Add", final_op="Id")
        shape = tf.TensorShape(value.shape)
        if shape.rank:
            out.set_shape([shape[0] // group.size if shape[0] is not None else None,
                           *shape[1:]])
        return out
    total = _member("reduce_scatter", tf.raw_ops.CollectiveReduceV2, value, group, device,
                    kind, merge_op="Add", final_op="Id")
    total.set_shape(value.shape)
    with tf.device(device):
        return tf.split(total, group.size, axis=0)[group.devices.index(device)]


def member_all_to_all(value: Any, group: Group, device: str, kind: str | None = None) -> Any:
    """``device``'s part of an all-to-all over ``group``: ``value``'s axis 0 cut into n
    equal slices, slice i sent to member i; the result is the slices the members sent to
    ``device``, concatenated along axis 0 in member order (the shape of ``value``; every
    member's must be the same). ``CollectiveAllToAllV2`` between GPUs; between CPUs the
    stand-in (module docstring), under the name scope the audit counts as an all-to-all."""
    import tensorflow as tf

    n = group.size
    if _hint(device) == "nccl":
        out = _member("all_to_all", tf.raw_ops.CollectiveAllToAllV2, value, group, device,
                      kind)
        out.set_shape(value.shape)
        return out
    gathered = _member("all_to_all", tf.raw_ops.CollectiveGatherV2, value, group, device,
                       kind)  # every member's n slices, member-major
    gathered.set_shape(_gathered_shape(value, n))
    with tf.device(device):
        mine = group.devices.index(device)
        slices = tf.split(gathered, n * n, axis=0)
        return tf.concat([slices[i * n + mine] for i in range(n)], axis=0)


def _bcast_attrs(group: Group, device: str) -> dict[str, Any]:
    return dict(group_size=group.size, group_key=group.key,
                instance_key=_instance_key(group, device), communication_hint=_hint(device),
                timeout_seconds=TIMEOUT_S)


def member_send(value: Any, group: Group, device: str, kind: str = "pp") -> Any:
    """``device``'s send of ``value`` to the other member of a two-device ``group`` (its
    ``member_receive``, in the same order): a broadcast from ``device``. Its output must
    be used (or depended on), else ``tf.function`` prunes the send."""
    import tensorflow as tf

    if device not in group.devices or group.size != 2:
        raise ValueError(f"A send needs a two-device group holding {device!r}; received "
                         f"{group.devices}.")
    with tf.name_scope(f"tfplan_broadcast_{kind}"), tf.device(device):
        moved = tf.cast(value, tf.float32) if value.dtype == tf.bfloat16 else value
        return tf.raw_ops.CollectiveBcastSendV2(input=moved, **_bcast_attrs(group, device))


def member_receive(shape: Any, dtype: Any, group: Group, device: str, kind: str = "pp"
                   ) -> Any:
    """``device``'s receive of what the other member of ``group`` sends (``member_send``):
    a tensor of ``shape`` (a shape tensor: its batch may be known only as it runs) and
    ``dtype``."""
    import tensorflow as tf

    moved = tf.float32 if dtype == tf.bfloat16 else dtype
    with tf.name_scope(f"tfplan_receive_{kind}"), tf.device(device):
        out = tf.raw_ops.CollectiveBcastRecvV2(shape=shape, T=moved,
                                               **_bcast_attrs(group, device))
        return tf.cast(out, dtype) if moved != dtype else out


def all_reduce(values: Sequence[Any], group: Group, kind: str | None = None) -> list[Any]:
    """The sum of ``values`` on every member (``CollectiveReduceV2``)."""
    import tensorflow as tf

    return _launch("all_reduce", tf.raw_ops.CollectiveReduceV2, values, group, kind,
                   merge_op="Add", final_op="Id")


def all_gather(values: Sequence[Any], group: Group, kind: str | None = None) -> list[Any]:
    """``values`` concatenated along axis 0 on every member (``CollectiveGatherV2``)."""
    import tensorflow as tf

    return _launch("all_gather", tf.raw_ops.CollectiveGatherV2, values, group, kind)


def reduce_scatter(values: Sequence[Any], group: Group, kind: str | None = None) -> list[Any]:
    """Member i gets slice i (of n equal slices along axis 0) of the sum of ``values``
    (``CollectiveReduceScatterV2`` on GPUs; the all-reduce stand-in on CPUs: module
    docstring). Axis 0 must divide by the group's size."""
    import tensorflow as tf

    if all(_hint(d) == "nccl" for d in group.devices):
        return _launch("reduce_scatter", tf.raw_ops.CollectiveReduceScatterV2, values, group,
                       kind, merge_op="Add", final_op="Id")
    # the CPU stand-in: the whole sum on every member, each keeping its own slice
    totals = _launch("reduce_scatter", tf.raw_ops.CollectiveReduceV2, values, group, kind,
                     merge_op="Add", final_op="Id")
    out = []
    for i, (total, device) in enumerate(zip(totals, group.devices)):
        with tf.device(device):
            out.append(tf.split(total, group.size, axis=0)[i])
    return out
