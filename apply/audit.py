"""The communication audit: the bytes each device of a wrapped model sends in one training step.

Pipeline position: beside ``apply.wrap``, read by ``plan audit`` and the tests. It measures
what ``planner.traffic`` prices (``Prediction.sent_bytes_per_device``), by the same kinds,
so a plan and the engine that runs it can be compared device by device.

How it measures: ``audit_step`` runs one step (``fit`` on one batch) of the wrapped model with
TensorFlow's run metadata on and reads the partitioned graphs the runtime executed (after
placement, the graphs of each device; Grappler's rewrites are switched off for that one
step so that every node keeps its traced name). Every variable the step changes (weights,
optimizer slots, metrics, the step counter) is restored afterwards: the audit leaves the
model as it found it.

* A cross-device copy (a ``_Send`` between two devices) counts its tensor's bytes for the
  sending device, once per tensor and receiving device, as TensorFlow sends it. Its size is
  the traced static shape's (the library's function definitions, then the step traced
  again in Python, whose graphs keep the shapes the definitions drop, e.g. a collective's
  output); where a tensor's shape is known only as the step runs, a
  second step runs with TensorFlow's debugger dumping every graph op's output shape
  (``tf.debugging.experimental.enable_dump_debug_info``, SHAPE mode, only the ops whose
  sizes are missing where they are collectives; not the measured step, whose transfers the
  debugger's ops would change; under one program per worker every worker runs that step,
  its collectives meeting the others'); a copy whose size neither gives
  is listed in ``Audit.unsized`` rather than counted as 0. Control edges (no data) are not counted.
* A collective counts its ring volume for each member: all-reduce 2 (n-1)/n N, all-gather
  (n-1)/n of the gathered result, reduce-scatter (n-1)/n N, all-to-all (n-1)/n N,
  broadcast N from the sender (``planner.collectives``). A CPU stand-in built by
  ``apply.collective_ops`` is counted as the collective it stands for (its name scope
  says which).

Offload's copies between a device and its host (a gradient to the host's optimizer state,
the update back: ``apply.placement``'s ``HOST_SCOPE``; with the weights offloaded, any copy
between a device and its host that is in none of the plan's groups) are kind ``host``: host
transfers, which the plan does not list either. The step's input batch, sent from where the input
pipeline put it to the devices that read it (``IteratorGetNext``'s outputs, or what an engine cuts of them under the
``tfplan_input`` name scope), is kind ``input``: feeding, not communication between the
devices (on GPUs it comes from host memory), and not part of the plan's bytes.

Other kinds follow ``planner.traffic.KINDS``: a transfer is attributed by its devices through
the plan's groups (``apply.groups``): members of one tensor-parallel group -> ``tp``;
neighbouring pipeline stages' devices -> ``pp``; one data-parallel group -> ``dp`` (a
ZeRO gather -> ``zero`` by its name scope); context- and expert-parallel groups -> ``cp``
and ``ep``; anything else -> ``other`` (a transfer the plan does not price).
"""
from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from tfplan import compat
from tfplan.apply.device_names import short_name
from tfplan.apply.groups import Groups, groups_of
from tfplan.apply.offload import host_device
from tfplan.apply.placement import HOST_SCOPE
from tfplan.planner.collectives import ring_allreduce_sent_bytes, ring_half_sent_bytes
from tfplan.planner.plan import Plan
from tfplan.planner.traffic import KINDS

AUDIT_KINDS = (*KINDS, "input", "host", "other")
INPUT_SCOPE = "tfplan_input"  # where an engine cuts the step's batch for its devices
# name scopes apply.collective_ops gives the collectives it builds, and the CPU stand-ins
STAND_IN = re.compile(r"tfplan_(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast)"
                      r"(?:_(tp|pp|dp|zero|cp|ep|workers))?(?:_\d+)?/")
_COLLECTIVES = {"CollectiveReduceV2": "all_reduce", "CollectiveGatherV2": "all_gather",
                "CollectiveReduceScatterV2": "reduce_scatter",
                "CollectiveAllToAllV2": "all_to_all", "CollectiveBcastSendV2": "broadcast",
                "CollectiveReduce": "all_reduce", "CollectiveGather": "all_gather",
                "CollectiveBcastSend": "broadcast", "NcclAllReduce": "all_reduce"}


@dataclass(frozen=True)
class Transfer:
    """One counted transfer: ``sender`` put ``nbytes`` on a link, of ``kind``."""

    sender: str
    kind: str
    nbytes: int
    what: str  # "copy to /device:CPU:1", "all_reduce over 4", ...
    tensor: str


@dataclass(frozen=True)
class Audit:
    """Bytes each device sent in one training step, by kind (``AUDIT_KINDS``)."""

    sent_bytes_per_device: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    transfers: tuple[Transfer, ...]
    unsized: tuple[str, ...]  # copies whose size could not be read (not counted)

    def by_device(self) -> dict[str, dict[str, int]]:
        return {d: dict(kinds) for d, kinds in self.sent_bytes_per_device}

    def total(self, device: str) -> int:
        return sum(self.by_device().get(device, {}).values())

    def to_dict(self) -> dict[str, Any]:
        return {"sent_bytes_per_device": self.by_device(),
                "unsized": list(self.unsized),
                "transfers": [{"sender": t.sender, "kind": t.kind, "bytes": t.nbytes,
                               "what": t.what, "tensor": t.tensor} for t in self.transfers]}


def compare(audit: Audit, priced: Any, devices: Any, tolerance: float = 0.10) -> dict:
    """The audit against a plan's priced bytes (``Prediction.sent_bytes_per_device`` or
    ``planner.traffic.plan_sent_bytes``), device by device, the input feeding and the host
    transfers left out:
    each device's measured and priced bytes by kind, their ratio, whether it is within
    ``tolerance``, and the busiest device's bytes over the mean (the issue's bar: within
    10%, at most 1.25). A JSON-ready dict (``plan audit --json``)."""
    measured = audit.by_device()
    prices = {d: dict(kinds) for d, kinds in priced}
    rows, totals = {}, []
    for d in devices:
        got = {k: v for k, v in measured.get(d, {}).items()
               if v and k not in ("input", "host")}
        want = {k: v for k, v in prices.get(d, {}).items() if v}
        sent, price = sum(got.values()), sum(want.values())
        ratio = sent / price if price else (1.0 if not sent else float("inf"))
        rows[d] = {"measured": got, "priced": want, "measured_bytes": sent,
                   "priced_bytes": price, "ratio": round(ratio, 4),
                   "within": abs(ratio - 1.0) <= tolerance}
        totals.append(sent)
    mean = sum(totals) / len(totals) if totals else 0.0
    busiest = max(totals) / mean if mean else 1.0
    return {"devices": rows, "busiest_over_mean": round(busiest, 3),
            "within_tolerance": all(r["within"] for r in rows.values()) and busiest <= 1.25,
            "tolerance": tolerance, "unsized": list(audit.unsized)}


def audit_step(model: Any, x: Any, y: Any = None, sample_weight: Any = None, *,
               plan: Plan | None = None) -> Audit:
    """Run one training step of the compiled ``model`` on (``x``, ``y``, ``sample_weight``)
    and report what each device sent (module docstring). ``plan``: the plan the model was
    wrapped with (its groups name the kinds); without it every transfer is ``other``.
    The model's variables, its optimizer's and its metrics' are restored afterwards."""
    if getattr(model, "optimizer", None) is None:
        raise ValueError("audit_step needs a compiled model (it runs one training step); "
                         "call model.compile(optimizer=..., loss=...) first.")
    import tensorflow as tf

    groups = groups_of(plan) if plan is not None else None
    data = tf.data.Dataset.from_tensors((x, y) if sample_weight is None
                                        else (x, y, sample_weight))  # static batch shapes
    known = compat.eager_function_names()
    run = getattr(model, "run_description", None)  # the SPMD engine's
    across = bool(run is not None and run.local)  # one program per worker
    with _restored(model), _grappler_off():
        try:
            if not model.optimizer.built:
                model.fit(data, epochs=1, verbose=0)  # builds the optimizer's slots (eagerly)
            model.make_train_function(force=True)  # traced and instantiated afresh, audited
            with compat.collect_run_metadata() as collected:
                model.fit(data, epochs=1, verbose=0)
            metadata = collected.metadata
            shapes = _traced_bytes(compat.eager_function_names() - known)
            transfers, unsized = _transfers(metadata, shapes, groups)
            if unsized:  # the step traced again in Python, whose graphs keep the static
                # shapes the library's function definitions lose (collectives' outputs)
                shapes = {**_python_traced_bytes(model, data), **shapes}
                transfers, unsized = _transfers(metadata, shapes, groups)
            if unsized or across:  # sizes known only as the step runs: from a step of its
                # own (across workers every worker runs it: its collectives meet the others')
                shapes = {**shapes, **_runtime_bytes(model, data, _op_types(unsized))}
                transfers, unsized = _transfers(metadata, shapes, groups)
        finally:
            model.make_train_function(force=True)  # training goes on without either
    per_device: dict[str, dict[str, int]] = {}
    for t in transfers:
        row = per_device.setdefault(t.sender, dict.fromkeys(AUDIT_KINDS, 0))
        row[t.kind] += t.nbytes
    sent = tuple((d, tuple(row.items())) for d, row in sorted(per_device.items()))
    return Audit(sent, tuple(transfers), tuple(unsized))


def _python_traced_bytes(model: Any, data: Any) -> dict[tuple[str, int], int]:
    """{(op name, output index): bytes} of every op output with a fully known static shape
    in ``model.train_step`` traced once more in Python on ``data``'s element spec (and the
    functions it calls): the names are the audited trace's, as the same code makes them,
    and the shapes keep what TensorFlow's function definitions drop (a collective's output
    shape, ``set_shape``). Tracing runs nothing."""
    import tensorflow as tf

    graph = tf.function(model.train_step, autograph=False).get_concrete_function(
        data.element_spec).graph
    return _graph_bytes(graph, compat.called_function_graphs)


def _op_types(unsized: list[str]) -> set[str] | None:
    """The op types of the unsized collectives (``_collective``'s label ``name (Op on
    device)``; none: the step runs, nothing instrumented); None where a copy is among them
    (its source may be any op)."""
    types = {m.group(1) for m in map(_UNSIZED_COLLECTIVE.search, unsized) if m}
    return types if all(map(_UNSIZED_COLLECTIVE.search, unsized)) else None


_UNSIZED_COLLECTIVE = re.compile(r" \((Collective\w+) on [^()]*\)$")


def _runtime_bytes(model: Any, data: Any, op_types: set[str] | None = None
                   ) -> dict[tuple[str, int], int]:
    """{(op name, output index): bytes} of every graph op's output as one more step ran,
    dumped by TensorFlow's debugger (its ops would add transfers: not the audited step);
    ``op_types``: only those ops' outputs (the debugger instruments only them: measured on
    a dp2 x tp2 transformer, 11 s and 0.2 GB of memory the process keeps, against 28 s and
    0.85 GB instrumenting every op)."""
    import tensorflow as tf

    if op_types is not None and not op_types:  # nothing to size: the step alone, traced
        model.make_train_function(force=True)  # afresh as the others' (its collectives' keys)
        model.fit(data, epochs=1, verbose=0)
        return {}
    dump = tempfile.mkdtemp(prefix="tfplan_audit_")
    try:
        model.make_train_function(force=True)
        tf.debugging.experimental.enable_dump_debug_info(
            dump, tensor_debug_mode="SHAPE", circular_buffer_size=-1,
            op_regex=None if op_types is None else "^(%s)$" % "|".join(sorted(op_types)))
        try:
            model.fit(data, epochs=1, verbose=0)
        finally:
            tf.debugging.experimental.disable_dump_debug_info()
        return compat.runtime_tensor_bytes(dump)
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def _transfers(metadata: Any, shapes: Mapping[tuple[str, int], int], groups: Groups | None
               ) -> tuple[list[Transfer], list[str]]:
    """The counted transfers of a step's partitioned graphs, and those of unknown size."""
    transfers: list[Transfer] = []
    unsized: list[str] = []
    seen: set[bytes] = set()
    for fg in metadata.function_graphs:
        for part in fg.partition_graphs:
            serialized = part.SerializeToString(deterministic=True)
            if serialized in seen:  # one instantiation listed twice
                continue
            seen.add(serialized)
            consts = {n.name: n for n in part.node if n.op == "Const"}
            nodes = {n.name: n for n in part.node}
            for node in part.node:
                if node.op in ("_Send", "_HostSend"):
                    t = _copy(node, shapes, groups, nodes)
                    if t is None:
                        continue
                    (transfers if isinstance(t, Transfer) else unsized).append(t)
                elif node.op in _COLLECTIVES:
                    t = _collective(node, consts, shapes, groups, nodes)
                    (transfers if isinstance(t, Transfer) else unsized).append(t)
    return transfers, unsized


def _copy(node: Any, shapes: Mapping[tuple[str, int], int], groups: Groups | None,
          nodes: Mapping[str, Any]) -> Any:
    src = short_name(node.attr["send_device"].s.decode())
    dst = short_name(node.attr["recv_device"].s.decode())
    source = node.input[0] if node.input else ""
    if "/ctrl/" in source or source.startswith("^") or src == dst:
        return None  # a control edge carries no data
    name, out = _traced_source(source, shapes, nodes)
    nbytes = shapes.get((name, out))
    if nbytes is None:
        return f"{name}:{out} ({src} -> {dst})"
    if _is_input(name):
        kind = "input"
    elif _in_scope(source.split(":")[0], HOST_SCOPE) or _in_scope(name, HOST_SCOPE):
        kind = "host"
    else:
        kind = groups.kind_of_pair(src, dst) if groups is not None else "other"
        if kind == "other" and (dst == short_name(host_device(src))
                                or src == short_name(host_device(dst))):
            kind = "host"  # to or from a device's host outside the plan's groups (offload)
    return Transfer(src, kind, nbytes, f"copy to {dst}", f"{name}:{out}")


def _is_input(name: str) -> bool:
    """Whether a sent tensor is the step's input batch (or a piece an engine cut of it under
    ``INPUT_SCOPE``): feeding the devices, not communication between them."""
    return name.split("/")[-1].startswith("IteratorGetNext") or _in_scope(name, INPUT_SCOPE)


def _in_scope(name: str, scope: str) -> bool:
    return any(p == scope or p.startswith(scope + "_") for p in name.split("/"))


def _collective(node: Any, consts: Mapping[str, Any], shapes: Mapping[tuple[str, int], int],
                groups: Groups | None, nodes: Mapping[str, Any]) -> Any:
    import tensorflow as tf

    device = short_name(node.device)
    op = _COLLECTIVES[node.op]
    scope = STAND_IN.search(node.name)
    kind_hint = None
    if scope:  # apply.collective_ops: the collective it builds (or stands in for)
        op, kind_hint = scope.group(1), scope.group(2)
    n = 0
    size_input = node.input[1] if len(node.input) > 1 else ""
    if size_input.split(":")[0] in consts:
        n = int(tf.make_ndarray(consts[size_input.split(":")[0]].attr["value"].tensor))
    elif "group_size" in node.attr:
        n = int(node.attr["group_size"].i)
    # its own output as it ran (the input's size; n times it for a gather), else its input
    own, _ = _traced_source(node.name + ":0", shapes, nodes)
    nbytes = shapes.get((own, 0))
    if nbytes is not None and node.op.startswith("CollectiveGather") and n >= 1:
        nbytes //= n
    if nbytes is None:
        name, out = _traced_source(node.input[0], shapes, nodes)
        nbytes = shapes.get((name, out))
    if nbytes is None or n < 1:
        return f"{node.name} ({node.op} on {device})"
    volume = {"all_reduce": ring_allreduce_sent_bytes(nbytes, n),
              "all_gather": ring_half_sent_bytes(n * nbytes, n),  # of the n x larger result
              "reduce_scatter": ring_half_sent_bytes(nbytes, n),
              "all_to_all": ring_half_sent_bytes(nbytes, n),
              "broadcast": float(nbytes)}[op]
    if kind_hint == "workers":  # one program per worker: the hosts' metric sums and
        kind = "host"            # barriers (apply.spmd.across), not the plan's traffic
    elif kind_hint:
        kind = kind_hint
    elif groups is not None:
        kind = groups.kind_of_group_size(device, n)
    else:
        kind = "other"
    return Transfer(device, kind, int(round(volume)), f"{op} over {n}", node.name)


def _traced_source(source: str, shapes: Mapping[tuple[str, int], int],
                   nodes: Mapping[str, Any]) -> tuple[str, int]:
    """The sized tensor behind ``source`` (``name:index`` in a partitioned graph): itself,
    the traced name the runtime's inlining prefixed (``_inlined``), or the tensor an
    identity the runtime added forwards (inlining a call gives each of its inputs and
    outputs an Identity named ``Func/<call>/input/_k``)."""
    name = source.split(":")[0]
    out = int(source.split(":")[1]) if ":" in source else 0
    for _ in range(16):
        if (name, out) in shapes:
            break
        inner = _inlined(name, out, shapes)
        if inner is not None:
            return inner, out
        node = nodes.get(name)
        if node is None or node.op not in ("Identity", "IdentityN") or not node.input:
            break
        nxt = node.input[out if node.op == "IdentityN" else 0]
        if nxt.startswith("^"):
            break
        name = nxt.split(":")[0]
        out = int(nxt.split(":")[1]) if ":" in nxt else 0
    return name, out


def _inlined(name: str, out: int, shapes: Mapping[tuple[str, int], int]) -> str | None:
    """``name`` without the leading call-op scopes the runtime's inlining prefixed it with
    (``StatefulPartitionedCall/dense/MatMul`` -> ``dense/MatMul``), when that is traced."""
    parts = name.split("/")
    for k in range(1, len(parts)):
        if "PartitionedCall" not in parts[k - 1]:
            break
        candidate = "/".join(parts[k:])
        if (candidate, out) in shapes:
            return candidate
    return None


def _traced_bytes(names: set[str]) -> dict[tuple[str, int], int]:
    """{(op name, output index): bytes} of every op output with a fully known static shape
    in the functions ``names`` (the step's traces) and those they call; an op of a called
    function also under ``<call op>/<name>`` (TensorFlow's name for it once inlined)."""
    graphs = compat.traced_graphs(names)

    def called(op: Any) -> list[Any]:
        return [graphs[name] for name in compat.called_function_names(op)
                if graphs.get(name) is not None]

    out: dict[tuple[str, int], int] = {}
    for name in names:
        if graphs.get(name) is not None:
            for key, nbytes in _graph_bytes(graphs[name], called).items():
                out.setdefault(key, nbytes)
    return out


def _graph_bytes(graph: Any, called: Any) -> dict[tuple[str, int], int]:
    """{(op name, output index): bytes} of every op output with a fully known static shape
    in ``graph`` and, to a depth of 8, the graphs ``called(op)`` gives for its ops, each
    under ``<call op>/<name>`` (TensorFlow's name for it once inlined); the first size
    found for a name wins."""
    out: dict[tuple[str, int], int] = {}

    def visit(g: Any, prefix: str, depth: int) -> None:
        for op in g.get_operations():
            for i, t in enumerate(op.outputs):
                try:
                    if t.shape.is_fully_defined():
                        out.setdefault((prefix + op.name, i),
                                       t.shape.num_elements() * t.dtype.size)
                except (ValueError, TypeError, AttributeError):
                    continue
            if depth < 8:
                for inner in called(op):
                    visit(inner, prefix + op.name + "/", depth + 1)

    visit(graph, "", 0)
    return out


@contextlib.contextmanager
def _restored(model: Any) -> Iterator[None]:
    """Every variable of the model, its optimizer and its metrics as they were before."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    variables += [v for m in getattr(model, "metrics", []) for v in m.variables]
    unique = list({id(v): v for v in variables}.values())
    saved = [np.array(v.numpy()) for v in unique]
    try:
        yield
    finally:
        for v, value in zip(unique, saved):
            if value.shape == tuple(v.shape):  # (a ZeRO-3 copy's freed weight holds none)
                v.assign(value)


@contextlib.contextmanager
def _grappler_off() -> Iterator[None]:
    import tensorflow as tf

    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": before.get("disable_meta_optimizer", False)})
