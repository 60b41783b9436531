"""Custom attention layers the planner splits by heads as a whole (keras_hub's
``LlamaAttention``, ``CachedGemmaAttention``, a user's attention block).

Pipeline position: the profiler records ``LayerProfile.attention_heads`` for such a
block (``profiler.static``); the planner offers it a ``heads`` split (``profiler.comm``,
``planner.tp_splits``), and ``apply`` runs one copy of the block's own ``call`` per
tensor-parallel rank on that rank's heads (Megatron-LM's attention split, Shoeybi et al.
2019, Sec. 3: each rank computes its heads' queries, keys and values -- columns of the
projections -- their attention, and its part of the output projection -- rows -- summed
over the ranks).

What makes a block one (``attention_block``): it is a block (``profiler.signature.is_block``)
that keeps its head counts as int attributes (``num_query_heads`` or ``num_heads``, and
``num_key_value_heads``, default the query heads), and among its direct sub-layers are
Keras ``EinsumDense`` projections whose kernel has a heads axis: *input* projections
(query, key, value) make it an output axis of size query heads or key/value heads, one
*output* projection contracts an axis of size query heads. Its own ``call`` must compute
each head apart from the others (true of attention); ``apply`` checks that the ranks'
outputs add up to the unsplit block's on a random input before it trains, and refuses the
split otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUERY_HEADS_ATTRIBUTES = ("num_query_heads", "num_heads")
KV_HEADS_ATTRIBUTE = "num_key_value_heads"


@dataclass(frozen=True)
class Projection:
    """One projection of an attention block: its sub-layer, whether it makes heads
    ("input": query, key, value) or contracts them ("output"), and its kernel's heads axis."""

    layer: Any
    role: str  # "input" or "output"
    heads_axis: int  # in the kernel
    heads: int  # the size of that axis


@dataclass(frozen=True)
class AttentionBlock:
    query_heads: int
    kv_heads: int
    heads_attributes: tuple[str, ...]  # attributes holding head counts (set per rank)
    projections: tuple[Projection, ...]


def _int_attribute(layer: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(layer, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def _heads_axis(layer: Any, sizes: set[int], produced: bool) -> tuple[int, int] | None:
    """(kernel axis, size) of an EinsumDense's heads axis: made by it (in the output, not
    the input) when ``produced``, else contracted (in the input, not the output)."""
    equation = str(getattr(layer, "equation", ""))
    kernel = getattr(layer, "kernel", None)
    if "->" not in equation or "," not in equation or "." in equation or kernel is None:
        return None
    inputs, out = equation.split("->")
    x, k = inputs.split(",")
    shape = tuple(int(d) for d in kernel.shape)
    for axis, letter in enumerate(k):
        kept = (letter in out and letter not in x) if produced else \
            (letter in x and letter not in out)
        if kept and shape[axis] in sizes:
            return axis, shape[axis]
    return None


def attention_block(layer: Any) -> AttentionBlock | None:
    """``layer`` as an attention block split by heads (module docstring), or None."""
    import keras

    from tfplan.profiler.signature import is_block, sublayers

    if not is_block(layer):
        return None
    query = _int_attribute(layer, QUERY_HEADS_ATTRIBUTES)
    if query is None:
        return None
    kv = _int_attribute(layer, (KV_HEADS_ATTRIBUTE,))
    q_heads, kv_heads = query[1], (kv[1] if kv else query[1])
    if q_heads % kv_heads:
        return None
    projections = []
    for sub in sublayers(layer):
        if type(sub) is not keras.layers.EinsumDense or not sub.built:
            continue
        made = _heads_axis(sub, {q_heads, kv_heads}, produced=True)
        if made is not None:
            projections.append(Projection(sub, "input", *made))
            continue
        used = _heads_axis(sub, {q_heads}, produced=False)
        if used is not None:
            projections.append(Projection(sub, "output", *used))
    roles = [p.role for p in projections]
    if roles.count("output") != 1 or "input" not in roles:
        return None
    names = (query[0],) + ((kv[0],) if kv else ())
    return AttentionBlock(q_heads, kv_heads, names, tuple(projections))
