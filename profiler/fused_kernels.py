"""Fused kernels in a measured trace: which graph ops one kernel ran, and how to split its time.

Pipeline position: helper of ``profiler.measure``, between reading the capture
(``profiler.xprof_reader``: time and kernel type per op name) and splitting op
times among layers by name scope (``measure.attribute_ops``). Pure: it sees the
traced step's graph as plain ``GraphOp`` records and imports no TensorFlow.

Why. Before a ``tf.function`` runs, Grappler's remapper and oneDNN's graph
rewrites replace chains such as ``Conv2D -> BiasAdd -> AddV2 -> Relu`` or
``MatMul -> BiasAdd -> Relu`` by one kernel (``_FusedConv2D``,
``_FusedMatMul``, ``_MklNativeFusedConv2D``, ``_MklNativeFusedMatMul``,
``_FusedBatchNormEx``...). The kernel carries the name of one original op only
-- the last of the chain -- so the trace has no event for the others. When the
chain crosses layers (a Dense without activation followed by an
``Activation('relu')`` layer; a convolution, a residual ``Add`` and its
``relu``) the layers of the other ops would get none of its time.

What is found (``find_fused_kernels``). A timed op whose kernel type in the
trace differs from its op type in the graph was rewritten. Starting from it,
the ops it ran are collected backwards through data inputs: an input op is
covered when it (a) has no trace event of its own, (b) is of a type such
rewrites fuse (``FUSIBLE``: contractions, ``FusedBatchNorm*``, bias adds,
elementwise arithmetic and activations, the reductions of a layer norm), and
(c) feeds only ops already covered (shape queries aside). (c) is the
remapper's own condition -- an intermediate result read elsewhere cannot
vanish into a kernel -- and keeps an op out that is missing from the trace for
another reason. The walk does not go past a contraction or a
``FusedBatchNorm*`` (``HEADS``): a fusion starts there. A rewrite that covers
no other op (``MatMul`` run as ``_MklMatMul``, ``MaxPool`` as
``_MklNativeMaxPool``) is not a fusion. Not found: ops a kernel fused from
beside it rather than from its inputs (``Conv2DBackpropFilter`` with
``BiasAddGrad`` as ``..BackpropFilterWithBias``); both are of one layer
there, so attribution is unchanged.

How its time is split (``spread_kernel_times``), the rule: a fused kernel's
time goes to the ops it ran in proportion to each op's FLOPs
(``profiler.op_flops`` conventions; an op without a count weighs 0), equally if
none has any. Time is conserved: the split times sum to the kernel's.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

#: Where a fusion starts: the walk covers these but not their inputs.
HEADS = frozenset((
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv2DBackpropFilter",
    "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "FusedBatchNorm", "FusedBatchNormV2",
    "FusedBatchNormV3"))
#: Op types a fused kernel may have absorbed besides HEADS: elementwise ops, layer-norm means.
ABSORBED = frozenset((
    "BiasAdd", "Add", "AddV2", "AddN", "Sub", "Mul", "RealDiv", "Maximum", "Minimum",
    "SquaredDifference", "Neg", "Square", "Sqrt", "Rsqrt", "Pow", "Exp", "Log", "Erf",
    "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Softplus", "Softsign",
    "Gelu", "Mean"))
FUSIBLE = HEADS | ABSORBED
#: Ops that read only a tensor's shape: reading an intermediate this way does not keep it.
SHAPE_READERS = frozenset(("Shape", "ShapeN", "Size", "Rank", "VariableShape"))
SPLIT_RULE = "in proportion to their ops' FLOPs"


@dataclass(frozen=True)
class GraphOp:
    """One op of the traced step's graph: its name, type, the ops it reads, its FLOPs."""

    name: str
    type: str
    inputs: tuple[str, ...] = ()  # names of the ops whose outputs it reads
    flops: int = 0


@dataclass(frozen=True)
class FusedKernel:
    """A kernel that ran several graph ops: ``op`` (the name it carries) first in ``covered``.

    ``shares[i]``: the fraction of the kernel's time that goes to ``covered[i]``
    (they sum to 1).
    """

    op: str
    kernel_type: str
    covered: tuple[str, ...]
    shares: tuple[float, ...]


def find_fused_kernels(ops: Sequence[GraphOp], timed_types: Mapping[str, str]
                       ) -> list[FusedKernel]:
    """The fused kernels among the timed ops (module docstring: which ops each ran).

    ``timed_types[name]``: the kernel type the trace gives op ``name`` (every op
    with a trace event). Each graph op is covered by one kernel at most.
    """
    by_name = {op.name: op for op in ops}
    consumers: dict[str, set[str]] = defaultdict(set)
    for op in ops:
        if op.type not in SHAPE_READERS:
            for src in op.inputs:
                consumers[src].add(op.name)
    claimed: set[str] = set()
    kernels = []
    for name in sorted(timed_types):
        root = by_name.get(name)
        if root is None or timed_types[name] == root.type:
            continue
        covered, inside = [name], {name}
        changed = True
        while changed:  # to a fixed point: an op read twice joins once both readers are in
            changed = False
            for op_name in list(covered):
                op = by_name[op_name]
                if op.type in HEADS:
                    continue
                for src in op.inputs:
                    p = by_name.get(src)
                    if (p is None or src in inside or src in timed_types or src in claimed
                            or p.type not in FUSIBLE or not consumers[src] <= inside):
                        continue
                    covered.append(src)
                    inside.add(src)
                    changed = True
        if len(covered) == 1:
            continue
        claimed |= inside
        flops = [max(by_name[c].flops, 0) for c in covered]
        total = sum(flops)
        shares = tuple(f / total for f in flops) if total else \
            tuple(1 / len(covered) for _ in covered)
        kernels.append(FusedKernel(name, timed_types[name], tuple(covered), shares))
    return kernels


def spread_kernel_times(op_time_s: Mapping[str, float], kernels: Sequence[FusedKernel]
                        ) -> dict[str, float]:
    """Op times with each fused kernel's time split among the ops it ran (``shares``).

    The sum of the times is unchanged.
    """
    out = dict(op_time_s)
    for k in kernels:
        seconds = out.pop(k.op, 0.0)
        for name, share in zip(k.covered, k.shares):
            out[name] = out.get(name, 0.0) + seconds * share
    return out


def shared_kernels(kernels: Sequence[FusedKernel], op_time_s: Mapping[str, float],
                   owner: Callable[[str], str | None], layers: Sequence[str]
                   ) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Which layers share a fused kernel, and one note per such kernel.

    ``owner(op name)``: the layer an op belongs to, or None (outside every
    layer); ``op_time_s``: the kernels' times (before spreading); ``layers``:
    the layer order to list them in. Returns ``({layer: other layers it shares
    a kernel with}, notes)``; a kernel whose ops are all of one layer (or of
    none) is not mentioned.
    """
    order = {name: i for i, name in enumerate(layers)}
    shared: dict[str, set[str]] = defaultdict(set)
    notes = []
    for k in kernels:
        share: dict[str | None, float] = defaultdict(float)
        for name, s in zip(k.covered, k.shares):
            share[owner(name)] += s
        named = sorted((l for l in share if l is not None), key=lambda l: order.get(l, 1 << 30))
        if len(share) < 2 or not named:
            continue
        for l in named:
            shared[l].update(m for m in named if m != l)
        parts = [f"{l} {100 * share[l]:.1f}%" for l in named]
        if None in share:
            parts.append(f"outside layers {100 * share[None]:.1f}%")
        notes.append(
            f"fused kernel {k.op} ({k.kernel_type}) ran ops of layers {', '.join(named)}"
            f"{' and ops outside layers' if None in share else ''}; its "
            f"{op_time_s.get(k.op, 0.0) * 1e3:.3f} ms per step is split {SPLIT_RULE}: "
            + ", ".join(parts))
    return ({l: tuple(sorted(o, key=lambda m: order.get(m, 1 << 30)))
             for l, o in shared.items()}, notes)
