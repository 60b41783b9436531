"""The attention cores of a traced training step: scores, softmax, dropout and context.

Pipeline position: a helper of ``profiler.op_attribution`` (inside
``profiler.op_graph.trace_training_step``), which sums what it finds per layer into
``LayerProfile.attention_core_flops_fwd``, ``attention_core_saved_bytes`` and
``attention_kv_bytes`` (``profiler.static``).

A core is found from the ops, not from the layer's type, so MultiHeadAttention,
GroupQueryAttention and custom attention layers are read alike. Inside one layer's
forward ops:

* a Softmax whose input comes (through element-wise ops: scale, mask) from a
  contraction (MatMul, BatchMatMul, Einsum) of two activations -- both operands depend
  on the model inputs, unlike a projection, which reads a weight -- the scores QK^T;
  and whose output reaches (through the dropout) a second contraction of two
  activations -- the context, scores x V;
* the core's ops: the two contractions, every op of the layer on a path between them,
  and the ops that feed only those and do not depend on the model inputs (the
  dropout's random numbers and mask, the causal mask), transitively;
* its keys: the scores' operand that holds the scores' last axis (the key positions,
  which the softmax normalises over); its values: the context's other operand. Each is
  followed back through the data movement inside the layer (views, Transpose, Tile,
  Cast: GroupQueryAttention's repeat of its key/value heads) to its smallest form,
  the projected keys and values that context parallelism exchanges.

What recomputing the core costs and frees (Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models", Sec. 4.1: the softmax output,
the dropout mask and the dropout output, 5 a s^2 b bytes in float16) follows from
these ops in ``profiler.op_attribution``: their FLOPs, and the saved tensors they
produce, except the context's output (the output projection's backward reads it, so
it stays).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

#: Contractions an attention core computes its scores and context with.
CONTRACTIONS = frozenset(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"))
#: Ops that move data without arithmetic, followed back from the core to the keys/values.
_MOVES = frozenset(("Reshape", "Squeeze", "ExpandDims", "Identity", "StopGradient",
                    "Snapshot", "EnsureShape", "Transpose", "Tile", "BroadcastTo", "Cast"))


@dataclass(frozen=True)
class AttentionCore:
    """One attention core: its layer, its ops (indices into the traced ops), the context
    contraction among them, and the key and value tensors it reads, smallest form."""

    owner: str
    ops: frozenset[int]
    context: int
    kv: tuple[Any, ...]


def find_cores(ops: Sequence[Any], index: Mapping[str, int], owner: Sequence[str | None],
               span: range, from_inputs: set[str], dead: set[int],
               bytes_of: Callable[[Any], int | None]) -> list[AttentionCore]:
    """The attention cores among the forward ops ``span`` of ``ops`` (see the module
    docstring). ``owner``: each op's layer; ``from_inputs``: names of the tensors that
    depend on the model inputs; ``dead``: forward ops TensorFlow prunes."""
    live = [i for i in span if i not in dead]
    consumers: dict[int, list[int]] = {}
    for i in live:
        for j in _producers(ops[i], index, span):
            consumers.setdefault(j, []).append(i)

    def contraction_of_activations(i: int) -> bool:
        op = ops[i]
        return op.type in CONTRACTIONS and len(op.inputs) == 2 and all(
            t.name in from_inputs for t in op.inputs)

    def nearest(start: int, step: Callable[[int], list[int]]) -> int | None:
        """The first contraction of activations reached from ``start`` along ``step``
        through data ops of the same layer; other contractions end a path."""
        layer, seen, todo = owner[start], {start}, [start]
        while todo:
            nxt = []
            for i in todo:
                for j in step(i):
                    if j in seen or owner[j] != layer or j in dead:
                        continue
                    seen.add(j)
                    if contraction_of_activations(j):
                        return j
                    if ops[j].type not in CONTRACTIONS and _data(ops[j], from_inputs):
                        nxt.append(j)
            todo = sorted(nxt)
        return None

    def upstream(i: int) -> list[int]:
        return [j for j, t in zip(_producers(ops[i], index, span, keep_all=True),
                                  ops[i].inputs) if j is not None and t.name in from_inputs]

    def downstream(i: int) -> list[int]:
        return consumers.get(i, [])

    cores, found = [], set()
    for i in live:
        if ops[i].type != "Softmax" or owner[i] is None or ops[i].outputs[0].name not in \
                from_inputs:
            continue
        scores, context = nearest(i, upstream), nearest(i, downstream)
        if scores is None or context is None or (scores, context) in found:
            continue
        found.add((scores, context))
        layer = owner[i]

        def inside(step: Callable[[int], list[int]]) -> Callable[[int], list[int]]:
            return lambda k: [j for j in step(k) if owner[j] == layer]

        after = _reach(scores, inside(downstream), stop=context)
        before = _reach(context, inside(upstream), stop=scores)
        core = (after & before) | {scores, context}
        for j in reversed(range(span.start, context)):  # the core's own side inputs
            if j in core or j in dead or owner[j] != layer or _data(ops[j], from_inputs):
                continue
            users = consumers.get(j)
            if users and all(u in core for u in users):
                core.add(j)
        key = ops[scores].inputs[_key_operand(ops[i], ops[scores], from_inputs)]
        value = next((t for t, j in zip(ops[context].inputs, _producers(
            ops[context], index, span, keep_all=True)) if j not in core),
            ops[context].inputs[1])
        kv = {t.name: t for t in (_smallest(key, layer, index, owner, ops, span, bytes_of),
                                  _smallest(value, layer, index, owner, ops, span, bytes_of))}
        cores.append(AttentionCore(layer, frozenset(core), context, tuple(kv.values())))
    return cores


def _producers(op: Any, index: Mapping[str, int], span: range, keep_all: bool = False
               ) -> list:
    """Indices (in ``span``) of the ops ``op`` reads; with ``keep_all`` one entry per
    input, None for an input made outside ``span``."""
    out = []
    for t in op.inputs:
        j = index.get(t.op.name)
        j = j if j is not None and j in span else None
        if j is not None or keep_all:
            out.append(j)
    return out


def _data(op: Any, from_inputs: set[str]) -> bool:
    return any(t.name in from_inputs for t in op.outputs)


def _reach(start: int, step: Callable[[int], list[int]], stop: int) -> set[int]:
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        for j in step(i):
            if j not in seen and j != stop and j != start:
                seen.add(j)
                todo.append(j)
    return seen


def _key_operand(softmax: Any, scores: Any, from_inputs: set[str]) -> int:
    """Which operand of the ``scores`` contraction holds the keys: the one with the axis
    the ``softmax`` normalises (its last: the key positions), followed back through the
    element-wise ops and Transposes between them. The second operand where that axis
    cannot be followed (a Reshape on the way) or both operands hold it."""
    t, axis = softmax.inputs[0], (softmax.outputs[0].shape.rank or 0) - 1
    while t.op.name != scores.name:
        op = t.op
        if op.type == "Transpose":
            perm = _static(op.inputs[1])
            if perm is None:
                return 1
            axis, t = int(perm[axis]), op.inputs[0]
            continue
        rank = t.shape.rank
        same = [x for x in op.inputs if x.name in from_inputs and x.shape.rank == rank
                and x.dtype.is_floating]
        if not same or op.type in CONTRACTIONS:
            return 1
        t = same[0]
    rank = len(scores.outputs[0].shape)
    if scores.type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "MatMul"):
        return {rank - 1: 1, rank - 2: 0}.get(axis, 1)
    try:
        equation = scores.get_attr("equation")
    except ValueError:
        return 1
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms, labels = lhs.split(","), rhs.replace("...", "")
    at = axis - (rank - len(labels))  # an ellipsis leads the output
    if len(terms) != 2 or not 0 <= at < len(labels):
        return 1
    holders = [k for k, term in enumerate(terms) if labels[at] in term]
    return holders[0] if len(holders) == 1 else 1


def _static(t: Any) -> Any:
    import tensorflow as tf

    return tf.get_static_value(t)


def _smallest(t: Any, layer: str, index: Mapping[str, int], owner: Sequence[str | None],
              ops: Sequence[Any], span: range, bytes_of: Callable[[Any], int | None]) -> Any:
    """``t`` followed back through data movement inside ``layer``: its smallest form
    (the earliest of equal sizes: the projection's output before a repeat or a view)."""
    best, best_bytes = t, bytes_of(t)
    while True:
        j = index.get(t.op.name)
        if j is None or j not in span or owner[j] != layer or t.op.type not in _MOVES or \
                not t.op.inputs:
            return best
        t = t.op.inputs[0]
        n = bytes_of(t)
        if n is not None and (best_bytes is None or n <= best_bytes):
            best, best_bytes = t, n
