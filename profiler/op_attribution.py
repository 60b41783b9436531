"""Per-layer numbers from a traced training step: gradient ops to layers, FLOPs, bytes, edges.

Pipeline position: inside ``profiler.op_graph.trace_training_step``, after the
step is traced and every forward op has its layer (by when it was created);
the resulting ``Trace`` goes to ``profiler.static``. FLOPs per op come from
``profiler.op_flops`` (``op_info`` describes a TensorFlow op for it).

* Gradient ops. A gradient op is named ``<scope>/<forward op name>_grad/...`` by
  ``tf.gradients`` and belongs to that forward op's layer. The few it creates
  outside such a scope (``AddN`` summing the gradients of a tensor read
  several times, or of a shared layer's weights) belong to the layer all their
  inputs come from, if there is one (a layer that reads its own input several
  times, like batch normalization; a shared layer's weight gradients); else
  (a tensor read by several layers) to the layer of the gradient op that
  reads the sum: the layer that produced the tensor. Gradient ops that no
  requested gradient depends on (e.g. MatMul's input gradient when the input
  is a model input) are never run by TensorFlow and are not counted; neither are
  forward ops that nothing run depends on (the step Keras' ``rnn`` traces outside
  its loop to learn output shapes).
* Counts. Every op's FLOPs come from ``profiler.op_flops``; an op that runs a function
  (a While loop, a nested ``tf.function``) from ``profiler.control_flow``: its body's
  ops times its trip count, or, where that is not static, nothing and a note in
  ``not_counted`` and ``Trace.unknown_loops``. Per layer the trace also
  measures: output and input bytes of its calls; the bytes kept for the
  backward pass (forward tensors that depend on the model inputs or on random
  numbers -- a dropout's mask -- and are read by gradient ops other than shape
  queries, each counted once -- a view made
  by Reshape/Squeeze/ExpandDims/Identity is its source tensor -- and charged to
  the layer that produced it; model inputs themselves are charged to nobody,
  they travel on input edges; a While loop's per-iteration accumulators count
  trips x the tensor pushed, ``profiler.control_flow``); the low-precision weight copies its ``Cast`` ops
  make from variable reads (mixed precision); and the tensors flowing between
  layers (edges), traced through ops outside any layer; and its attention cores
  (``profiler.attention_core``): their forward FLOPs, the saved bytes only they
  hold, and the keys and values they read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tfplan.profiler.attention_core import find_cores
from tfplan.profiler.control_flow import ControlFlow
from tfplan.profiler.op_flops import NO_TRAFFIC_OPS, OpCount, OpInfo, count_op, is_matmul

#: Attributes the FLOP formulas read, by op type.
_ATTRS = {"MatMul": ("transpose_a",), "BatchMatMul": ("adj_x",), "BatchMatMulV2": ("adj_x",),
          "BatchMatMulV3": ("adj_x",), "Einsum": ("equation",),
          **{t: ("ksize",) for t in ("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D",
                                     "MaxPoolGrad", "AvgPoolGrad", "MaxPool3DGrad",
                                     "AvgPool3DGrad")},
          **{t: ("is_training",) for t in ("FusedBatchNorm", "FusedBatchNormV2",
                                           "FusedBatchNormV3", "FusedBatchNormGrad",
                                           "FusedBatchNormGradV2", "FusedBatchNormGradV3")}}
#: Ops that read only a tensor's shape: reading a forward tensor this way keeps nothing alive.
_SHAPE_READERS = frozenset(("Shape", "ShapeN", "Size", "Rank", "VariableShape"))
#: Ops whose output shares its input's buffer in TensorFlow (no copy): a saved tensor made
#: by one of these is its input, counted where that was produced.
_VIEWS = frozenset(("Reshape", "Squeeze", "ExpandDims", "Identity", "StopGradient",
                    "Snapshot", "EnsureShape"))
LOSS = "<loss>"


@dataclass(frozen=True)
class OpRecord:
    """One traced op: its layer (None: outside any layer), pass and count."""

    name: str
    type: str
    owner: str | None
    phase: str  # "fwd", "bwd" or "loss"
    flops: int
    problem: str | None


@dataclass
class LayerTrace:
    """What the trace measured for one profiled layer, over all its calls."""

    calls: int = 0
    flops_fwd: int = 0
    flops_bwd: int = 0
    matmul_flops_fwd: int = 0
    matmul_flops_bwd: int = 0
    traffic_bytes_fwd: int = 0  # bytes read + written by the ops that are not contractions
    traffic_bytes_bwd: int = 0
    output_bytes: int = 0
    input_bytes: int = 0
    float_input_bytes: int = 0  # of input_bytes, the floating-point tensors'
    saved_bytes: int = 0
    compute_weight_bytes: int = 0
    # attention cores (``profiler.attention_core``): forward FLOPs, the saved bytes they
    # alone produce, and the projected keys and values they read
    attention_core_flops_fwd: int = 0
    attention_core_saved_bytes: int = 0
    attention_kv_bytes: int = 0
    not_counted: list[str] = field(default_factory=list)


@dataclass
class Trace:
    """The result of ``trace_training_step``; ``graph`` is the FuncGraph (for tests)."""

    layers: dict[str, LayerTrace]
    edges: list[tuple[str, str, int]]  # (source layer or model input name, layer, bytes)
    outside: dict[str, list[str]]  # label of a non-layer operation -> what it does uncounted
    ops: tuple[OpRecord, ...]
    input_names: tuple[str, ...]
    graph: Any = None
    has_backward: bool = True
    # While loops whose trip count is not static: (op name, its layer or None, why)
    unknown_loops: tuple[tuple[str, str | None, str], ...] = ()


# --- counting --------------------------------------------------------------------------------
class Accounting:
    """Turns the traced ops and recorded calls into per-layer numbers."""

    def __init__(self, rec: Any, ops: list[Any], marks: Mapping[str, int],
                 inputs: list[Any], specs: Sequence[Any], compute_dtype: str | None,
                 progress: Callable[[str, int, int], None] | None, loss_present: bool,
                 outputs: Sequence[Any] = ()):
        """``rec``: the recorder of the trace (profiled layer keys, calls, op owners);
        ``ops``: the graph's ops in creation order; ``marks``: where the forward, loss
        and gradient ops start and end; ``inputs``/``specs``: the input placeholders
        and their specs; ``outputs``: the model's output tensors.
        """
        import tensorflow as tf

        self.rec, self.ops, self.marks, self.progress = rec, ops, marks, progress
        self.input_of = {t.name: s.name for t, s in zip(inputs, specs)}
        self.override = tf.as_dtype(compute_dtype).size if compute_dtype else None
        self.loss_present = loss_present
        self.outputs = list(outputs)
        self.index = {op.name: i for i, op in enumerate(ops)}
        self.owner: list[str | None] = [None] * len(ops)
        self.label: list[str] = [""] * len(ops)
        self.layers: dict[str, LayerTrace] = {k: LayerTrace() for k in rec.keys.values()}
        self.outside: dict[str, list[str]] = {}
        self.live: set[int] = set()
        self.dead_forward: set[int] = set()
        self.used: dict[int, set[int]] = {}  # live gradient op -> the outputs read
        self.flops_of: dict[int, int] = {}  # op index -> FLOPs of the ops counted
        self.saved: dict[str, int] = {}  # saved tensor name -> index of its producer
        self.from_inputs: set[str] = set()  # tensors that depend on the model inputs
        self.flow = ControlFlow(op_info, self.traffic_bytes)

    # bytes
    def bytes_of(self, t: Any) -> int | None:
        return tensor_bytes(t, self.override)

    def traffic_bytes(self, op: Any) -> int:
        return traffic_bytes(op, self.override)

    def run(self, graph: Any, grads: Sequence[Any]) -> Trace:
        fwd, loss, grad, end = (self.marks[k] for k in ("fwd", "loss", "grad", "end"))
        self.live = self._live(grads, grad, end)
        self.dead_forward = self._dead_forward(fwd, loss, grad, end)
        lookup = self.rec.owner_of_index()
        for i in range(fwd, loss):
            self.owner[i], self.label[i] = lookup(i)
        for i in range(loss, end):
            self.owner[i], self.label[i] = LOSS, LOSS
        self._attribute_gradients(fwd, loss, grad, end)
        records = self._count(fwd, end, grad)
        self._calls()
        edges = self._edges(fwd, loss)
        self._saved(fwd, loss, grad, end)
        self._attention_cores(fwd, loss)
        self._compute_weights(fwd, loss)
        unknown = tuple((r.name, r.owner, r.problem) for r in records
                        if r.type in ("While", "StatelessWhile") and r.problem)
        return Trace(self.layers, edges, self.outside, tuple(records),
                     tuple(self.input_of.values()), graph, has_backward=self.loss_present,
                     unknown_loops=unknown)

    def _live(self, grads: Sequence[Any], grad: int, end: int) -> set[int]:
        """Gradient ops the returned gradients depend on (TensorFlow prunes the rest at run time).

        Gradient functions build some ops nobody asked for -- e.g. MatMul's input
        gradient when the input is a model input -- and the executor never runs them.
        """
        import keras

        live: set[int] = set()
        todo = [(t.op, t.value_index) for g in grads for t in keras.tree.flatten(
            [g.values, g.indices] if hasattr(g, "indices") else g)]
        while todo:
            op, output = todo.pop()
            i = self.index.get(op.name)
            if i is None or i < grad:
                continue
            if output is not None:  # which outputs of a function call are read
                self.used.setdefault(i, set()).add(output)
            if i in live:
                continue
            live.add(i)
            todo.extend((t.op, t.value_index) for t in op.inputs)
            todo.extend((c, None) for c in op.control_inputs)
        return live

    def _dead_forward(self, fwd: int, loss: int, grad: int, end: int) -> set[int]:
        """Forward ops that neither a model output, the loss, a live gradient op nor a
        stateful op (a variable update) depends on: TensorFlow prunes them. E.g. the step Keras' ``rnn``
        traces once outside its loop to learn the output shapes. None without a loss."""
        if not self.loss_present:
            return set()
        reached: set[int] = set()
        todo = [self.ops[i] for i in range(loss, grad)] + [self.ops[i] for i in self.live]
        todo += [self.ops[i] for i in range(fwd, loss) if self.ops[i].op_def.is_stateful]
        todo += [t.op for t in self.outputs]
        while todo:
            op = todo.pop()
            i = self.index.get(op.name)
            if i is None or i in reached:
                continue
            reached.add(i)
            todo.extend(t.op for t in op.inputs)
            todo.extend(op.control_inputs)
        return set(range(fwd, loss)) - reached

    def _attribute_gradients(self, fwd: int, loss: int, grad: int, end: int) -> None:
        forward = {self.ops[i].name: i for i in range(fwd, grad)}
        pending = []
        for i in range(grad, end):
            name = self.ops[i].name
            rest = name.split("/", 1)[1] if "/" in name else name
            at, found = len(rest), None
            while found is None:
                at = rest.rfind("_grad/", 0, at)
                if at < 0:
                    break
                found = forward.get(rest[:at])
            if found is not None:
                self.owner[i], self.label[i] = self.owner[found], self.label[found]
            else:
                self.owner[i], self.label[i] = None, ""
                pending.append(i)
        if not pending:
            return
        resolved = set(range(grad, end)) - set(pending)
        left = []
        for i in pending:  # inputs come earlier: all from one layer -> that layer
            owners = {self.owner[j] for j in self._producers(i, fwd) if j in resolved or j < grad}
            owners.discard(None)
            if len(owners) == 1:
                self.owner[i] = owners.pop()
                self.label[i] = self.owner[i]
                resolved.add(i)
            else:
                left.append(i)
        consumers: dict[int, list[int]] = {}
        for i in range(grad, end):
            for j in self._producers(i, grad):
                consumers.setdefault(j, []).append(i)
        for i in reversed(left):  # consumers come later: resolve from the end
            for c in consumers.get(i, ()):
                if c in resolved:
                    self.owner[i], self.label[i] = self.owner[c], self.label[c]
                    resolved.add(i)
                    break

    def _producers(self, i: int, start: int) -> list[int]:
        """Indices (>= start) of the ops whose outputs op ``i`` reads."""
        out = []
        for t in self.ops[i].inputs:
            j = self.index.get(t.op.name)
            if j is not None and j >= start:
                out.append(j)
        return out

    def _count(self, fwd: int, end: int, grad: int) -> list[OpRecord]:
        records = []
        total = end - fwd
        for n, i in enumerate(range(fwd, end)):
            op = self.ops[i]
            if (i >= grad and i not in self.live) or i in self.dead_forward:
                continue
            info = op_info(op)
            body = self.flow.count(op, self.used.get(i) if i >= grad else None)
            count = count_op(info) if body is None else OpCount(body.flops, body.unknown)
            owner = self.owner[i]
            phase = "loss" if owner == LOSS else ("bwd" if i >= grad else "fwd")
            records.append(OpRecord(op.name, op.type, owner, phase, count.flops, count.problem))
            self.flops_of[i] = count.flops
            acc = self.layers.get(owner) if owner is not None else None
            if owner is None and (count.flops or count.problem):
                self.outside.setdefault(self.label[i] or "model", []).append(
                    f"{op.name} ({op.type}): " + (count.problem or f"{count.flops} FLOPs"))
            if acc is not None:
                if body is not None:
                    matmul_flops, traffic = body.matmul_flops, body.traffic_bytes
                else:
                    matmul_flops = count.flops if is_matmul(info) else 0
                    traffic = 0 if is_matmul(info) else self.traffic_bytes(op)
                if phase == "bwd":
                    acc.flops_bwd += count.flops
                    acc.matmul_flops_bwd += matmul_flops
                    acc.traffic_bytes_bwd += traffic
                else:
                    acc.flops_fwd += count.flops
                    acc.matmul_flops_fwd += matmul_flops
                    acc.traffic_bytes_fwd += traffic
                if count.problem:
                    acc.not_counted.append(_problem(op, count))
                if body is not None:
                    acc.not_counted.extend(body.problems)
            if self.progress is not None and (n % 2000 == 0 or n == total - 1):
                self.progress("count", n + 1, total)
        return records

    def _calls(self) -> None:
        for call in self.rec.calls:
            acc = self.layers[call.key]
            acc.calls += 1
            # an input read twice (self-attention's query and value) is one tensor
            inputs = list({t.name: t for t in call.inputs}.values())
            for what, tensors in (("output", call.outputs), ("input", inputs)):
                for t in tensors:
                    b = self.bytes_of(t)
                    if b is None:
                        note = f"{what} {t.name} has shape {t.shape} / dtype {t.dtype.name}: " \
                               f"its bytes are not counted"
                        if note not in acc.not_counted:
                            acc.not_counted.append(note)
                    elif what == "output":
                        acc.output_bytes += b
                    else:
                        acc.input_bytes += b
                        if t.dtype.is_floating:
                            acc.float_input_bytes += b

    def _edges(self, fwd: int, loss: int) -> list[tuple[str, str, int]]:
        origins: dict[str, frozenset] = {}

        def origin(t: Any) -> frozenset:
            if t.name in origins:
                return origins[t.name]
            result: frozenset = frozenset()
            if t.name in self.input_of:
                result = frozenset(((self.input_of[t.name], t.name),))
            else:
                j = self.index.get(t.op.name)
                if j is not None and fwd <= j < loss:
                    if self.owner[j] is not None:
                        result = frozenset(((self.owner[j], t.name),))
                    else:  # an op outside any layer: look through it
                        result = frozenset().union(*(origin(x) for x in self.ops[j].inputs))
            origins[t.name] = result
            return result

        edges, seen = [], set()
        for i in range(fwd, loss):
            dst = self.owner[i]
            if dst is None or dst not in self.layers:
                continue
            for t in self.ops[i].inputs:
                for src, tensor_name in sorted(origin(t)):
                    if src == dst or (tensor_name, dst) in seen:
                        continue
                    seen.add((tensor_name, dst))
                    edges.append((src, dst, self.bytes_of(self._tensor(tensor_name)) or 0))
        return edges

    def _tensor(self, name: str) -> Any:
        op_name, _, index = name.rpartition(":")
        return self.ops[self.index[op_name]].outputs[int(index)]

    def _saved(self, fwd: int, loss: int, grad: int, end: int) -> None:
        # tensor names that depend on a model input, and those that differ from step to
        # step without one (random numbers: a dropout mask is kept for the backward pass)
        self.from_inputs = from_inputs = set(self.input_of)
        data = set(self.input_of)
        for i in range(fwd, loss):
            op = self.ops[i]
            if any(t.name in from_inputs for t in op.inputs):
                from_inputs.update(t.name for t in op.outputs)
            if _is_random(op.type) or any(t.name in data for t in op.inputs):
                data.update(t.name for t in op.outputs)
        counted: set[str] = set()
        for i in sorted(self.live):
            op = self.ops[i]
            if op.type in _SHAPE_READERS:
                continue
            for t in op.inputs:
                while t.op.type in _VIEWS and t.op.inputs:  # the buffer a view shares
                    t = t.op.inputs[0]
                if t.name in counted or t.name not in data or t.name in self.input_of:
                    continue
                j = self.index.get(t.op.name)
                if j is None or not fwd <= j < loss:
                    continue
                counted.add(t.name)
                self.saved[t.name] = j
                acc = self.layers.get(self.owner[j]) if self.owner[j] is not None else None
                if acc is not None:
                    acc.saved_bytes += self.bytes_of(t) or \
                        self.flow.accumulated_bytes(t, self.bytes_of)

    def _attention_cores(self, fwd: int, loss: int) -> None:
        """Per layer, its attention cores' forward FLOPs (as counted), the saved tensors
        their ops produce but the context (the output projection's backward reads it),
        and the bytes of the keys and values they read (``profiler.attention_core``)."""
        for core in find_cores(self.ops, self.index, self.owner, range(fwd, loss),
                               self.from_inputs, self.dead_forward, self.bytes_of):
            acc = self.layers.get(core.owner)
            if acc is None:
                continue
            acc.attention_core_flops_fwd += sum(self.flops_of.get(i, 0) for i in core.ops)
            acc.attention_core_saved_bytes += sum(
                self.bytes_of(self._tensor(name)) or 0 for name, j in self.saved.items()
                if j in core.ops and j != core.context)
            acc.attention_kv_bytes += sum(self.bytes_of(t) or 0 for t in core.kv)

    def _compute_weights(self, fwd: int, loss: int) -> None:
        seen = set()
        for i in range(fwd, loss):
            op = self.ops[i]
            if op.type != "Cast" or self.owner[i] not in self.layers:
                continue
            source = op.inputs[0]
            if source.op.type != "ReadVariableOp" or source.dtype == op.outputs[0].dtype:
                continue
            key = (self.owner[i], source.op.inputs[0].name)
            if key not in seen:
                seen.add(key)
                self.layers[self.owner[i]].compute_weight_bytes += \
                    self.bytes_of(op.outputs[0]) or 0


def tensor_bytes(t: Any, float_size: int | None = None) -> int | None:
    """Bytes of a traced tensor (None: unknown shape, or a resource/variant handle);
    ``float_size``: bytes per element to price floating-point tensors in instead of
    their own dtype (a profile in another precision)."""
    if not t.shape.is_fully_defined() or t.dtype.name in ("resource", "variant"):
        return None
    size = float_size if float_size and t.dtype.is_floating else t.dtype.size
    return t.shape.num_elements() * size


def traffic_bytes(op: Any, float_size: int | None = None) -> int:
    """Bytes an op that is not a contraction reads and writes: its inputs plus its
    outputs (unknown shapes count 0), or 0 for ``NO_TRAFFIC_OPS``. The roofline's
    memory side (Williams, Waterman & Patterson, "Roofline", CACM 2009): each op
    reads its operands from memory and writes its results back, as TensorFlow's
    executor runs them without fusion."""
    if op.type in NO_TRAFFIC_OPS:
        return 0
    return sum(tensor_bytes(t, float_size) or 0 for t in (*op.inputs, *op.outputs))


def _is_random(op_type: str) -> bool:
    """Whether an op draws random numbers (RandomUniform, StatelessRandomUniformV2,
    TruncatedNormal, Multinomial...): its outputs change every step."""
    return "Random" in op_type or "TruncatedNormal" in op_type or "Multinomial" in op_type


def op_info(op: Any) -> OpInfo:
    """The ``OpInfo`` of a TensorFlow op: type, static shapes, the attributes formulas read."""
    attrs = {}
    for name in _ATTRS.get(op.type, ()):
        try:
            value = op.get_attr(name)
        except ValueError:
            continue
        attrs[name] = value.decode() if isinstance(value, bytes) else value
    if op.type in ("MaxPoolV2", "MaxPoolGradV2"):
        import tensorflow as tf

        k = tf.get_static_value(op.inputs[1 if op.type == "MaxPoolV2" else 3])
        if k is not None:
            attrs["ksize"] = [int(x) for x in k]
    return OpInfo(op.name, op.type, tuple(_shape(t) for t in op.inputs),
                  tuple(_shape(t) for t in op.outputs), attrs)


def _shape(t: Any) -> tuple | None:
    if t.shape.rank is None:
        return None
    return tuple(t.shape.as_list())


def _count(op: Any) -> OpCount:
    return count_op(op_info(op))


def _problem(op: Any, count: OpCount) -> str:
    what = f"{op.name} ({op.type})"
    return what if count.problem == "no FLOP formula for this op type" else \
        f"{what}: {count.problem}"
