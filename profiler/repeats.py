"""Finding identical repeated blocks of layers, so that big models are traced once per block type.

Pipeline position: used by ``profiler.static`` before ``profiler.op_graph``
traces a model. A 1e12-parameter GPT is 128 copies of one transformer block;
tracing and differentiating all of them takes minutes, while their costs are
copies of each other. ``find_repeats`` finds runs of R >= 4 consecutive blocks
of P layers that are the same: per position, the same layer class and config
(but the name), the same weight shapes, dtypes and trainability, the same input
and output shapes and dtypes, and the same wiring -- every input comes from the
same relative position, inside the block or in the block before it.

The trace then computes blocks 0, 1 and 2 of a run and skips blocks 3..R-1:
each skipped layer returns the outputs of the layer at its position in block 2
(``skip_map``), so the layers after the run read block 2's outputs. In that
graph block 0 is the real first block, block 1 a real middle block (fed by a
block, feeding a block) and block 2 plays the last block (fed by a block,
feeding what follows the run). ``source_of`` says whose numbers each real layer
takes -- middle blocks 2..R-2 copy block 1, the last block copies the traced
block 2 -- and ``replicate_edges`` rebuilds the edges of the skipped blocks the
same way. The numbers are identical to tracing every block (a test checks it
on a small GPT). Runs are only used where every layer in them is called once,
no block's outputs leave the run except the last block's, and the model has
no ``keras.ops`` calls between layers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from tfplan import compat
from tfplan.profiler.signature import layer_config

MIN_REPEATS = 4


@dataclass(frozen=True)
class RepeatRun:
    """R identical blocks of P layer names, in order."""

    blocks: tuple[tuple[str, ...], ...]

    @property
    def skipped(self) -> tuple[tuple[str, ...], ...]:
        return self.blocks[3:]


def _functional(model: Any) -> Any | None:
    return compat.layer_graph(model)


def _signature(layer: Any, node: Any, index: dict[int, int], i: int) -> str | None:
    import keras

    if isinstance(layer, keras.Model):
        return None
    try:
        config = layer_config(layer)
    except Exception:  # noqa: BLE001 -- no config: the layer is not compared, traced
        return None
    config.pop("name", None)

    def describe(x: Any) -> Any:
        history = compat.keras_history(x)
        if history is None:
            return repr(x)
        j = index.get(id(history.operation))
        if j is None:
            return ("external", id(x))
        return ("relative", j - i, history.tensor_index)

    args = keras.tree.map_structure(describe, (node.arguments.args, node.arguments.kwargs))
    weights = [(tuple(w.shape), str(w.dtype), bool(w.trainable)) for w in layer.weights]
    outputs = [(tuple(t.shape), str(t.dtype)) for t in node.outputs]
    return json.dumps([type(layer).__module__ + "." + type(layer).__qualname__, config,
                       weights, outputs, args], sort_keys=True, default=repr)


def find_repeats(model: Any, min_repeats: int = MIN_REPEATS) -> list[RepeatRun]:
    """The runs of identical blocks in ``model``'s top-level layer graph (may be empty)."""
    from keras import Layer

    graph = _functional(model)
    if graph is None:
        return []
    nodes: dict[int, list[Any]] = {}
    by_depth = compat.nodes_by_depth(graph)
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            op = node.operation
            if op is None or node.is_input or type(op).__name__ == "InputLayer":
                continue
            if not isinstance(op, Layer):
                return []  # a keras.ops call between layers: not handled, trace everything
            nodes.setdefault(id(op), []).append(node)
    layers = [l for l in model.layers if type(l).__name__ != "InputLayer"]
    if {id(l) for l in layers} != set(nodes) or len(layers) < min_repeats:
        return []
    index = {id(l): i for i, l in enumerate(layers)}
    sigs = [(_signature(l, nodes[id(l)][0], index, i) if len(nodes[id(l)]) == 1 else None)
            for i, l in enumerate(layers)]
    kinds: dict[str, int] = {}  # compare small ints, not long strings
    keys = [kinds.setdefault(s, len(kinds)) if s is not None else -1 - i
            for i, s in enumerate(sigs)]
    runs = _best_runs(keys, min_repeats)
    return [RepeatRun(tuple(tuple(layers[s + j * p + k].name for k in range(p))
                            for j in range(r)))
            for s, p, r in runs if _valid(graph, layers, index, s, p, r)]


def _best_runs(sigs: Sequence[int], min_repeats: int) -> list[tuple[int, int, int]]:
    """Non-overlapping (start, period, repeats), most layers skipped first."""
    n = len(sigs)
    candidates = []
    for p in range(1, n // min_repeats + 1):
        i = 0
        while i + p < n:
            if sigs[i] != sigs[i + p]:
                i += 1
                continue
            j = i
            while j + p < n and sigs[j] == sigs[j + p]:
                j += 1
            r = 1 + (j - i) // p
            if r >= min_repeats:
                candidates.append(((r - 3) * p, -p, i, r))
            i = j
    chosen: list[tuple[int, int, int]] = []
    taken: set[int] = set()
    for _, neg_p, s, r in sorted(candidates, reverse=True):
        span = set(range(s, s + r * -neg_p))
        if not span & taken:
            taken |= span
            chosen.append((s, -neg_p, r))
    return sorted(chosen)


def _valid(graph: Any, layers: list[Any], index: dict[int, int], s: int, p: int, r: int
           ) -> bool:
    """Blocks >= 1 read only their own or the previous block; only the last one feeds on."""
    end = s + r * p
    outputs = {id(compat.producer(t)) for t in graph.outputs}
    by_depth = compat.nodes_by_depth(graph)
    for depth in by_depth:
        for node in by_depth[depth]:
            op = node.operation
            if op is None or node.is_input or id(op) not in index:
                continue
            i = index[id(op)]
            block_start = s + (i - s) // p * p
            for t in node.input_tensors:
                j = index.get(id(compat.producer(t)))
                if s + p <= i < end and (j is None or not block_start - p <= j < i):
                    return False  # a later block reads from outside itself and its predecessor
                if j is not None and s <= j < end - p and not s <= i < end:
                    return False  # a block before the last one feeds a layer after the run
    return not any(id(layers[i]) in outputs for i in range(s, end - p))


def with_block_entries(runs: Sequence[RepeatRun], names: Sequence[str]) -> list[RepeatRun]:
    """``runs`` with each block (a custom layer with sub-layers:
    ``profiler.signature.is_block``) followed by its sub-layers' entries (``block/...``,
    in profile order), so that a skipped copy's sub-layers take their numbers and edges
    from the traced copy's. A run whose copies list different sub-layers is dropped
    (traced whole)."""
    listed = set(names)
    inside: dict[str, list[str]] = {}
    for name in names:
        head, sep, _ = name.partition("/")
        if sep and head in listed:  # a top-level block's entry (not a nested model's layer)
            inside.setdefault(head, []).append(name)
    out = []
    for run in runs:
        blocks = tuple(tuple(n for top in block for n in (top, *inside.get(top, ())))
                       for block in run.blocks)
        if len({len(b) for b in blocks}) == 1:
            out.append(RepeatRun(blocks))
    return out


def skip_map(runs: Sequence[RepeatRun], layer_of: dict[str, Any]) -> dict[int, int]:
    """id(layer in a skipped block) -> id(layer at the same position in block 2)."""
    return {id(layer_of[name]): id(layer_of[run.blocks[2][k]])
            for run in runs for block in run.skipped for k, name in enumerate(block)}


def source_of(runs: Sequence[RepeatRun]) -> dict[str, str]:
    """Real layer name -> the traced layer whose numbers it takes (where they differ)."""
    out: dict[str, str] = {}
    for run in runs:
        r = len(run.blocks)
        for j in range(2, r):
            src = run.blocks[1] if j < r - 1 else run.blocks[2]
            for k, name in enumerate(run.blocks[j]):
                if name != src[k]:
                    out[name] = src[k]
    return out


def replicate_edges(runs: Sequence[RepeatRun], edges: Sequence[tuple[str, str, int]]
                    ) -> list[tuple[str, str, int]]:
    """The traced edges, with those of blocks 2..R-1 rebuilt from blocks 1 and 2 (see above)."""
    out = list(edges)
    for run in runs:
        r = len(run.blocks)
        where = {name: (j, k) for j in range(3) for k, name in enumerate(run.blocks[j])}
        kept = []
        for src, dst, nbytes in out:
            a, b = where.get(src), where.get(dst)
            ja, jb = (a[0] if a else -1), (b[0] if b else -1)
            if ja < 2 and jb < 2:  # not touching the traced block 2: real as traced
                kept.append((src, dst, nbytes))
                if ja == jb == 1:  # inside a middle block: also inside blocks 2..R-2
                    kept.extend((run.blocks[j][a[1]], run.blocks[j][b[1]], nbytes)
                                for j in range(2, r - 1))
            elif ja == 1 and jb == 2:  # block j-1 -> block j, for j = 2..R-1
                kept.extend((run.blocks[j - 1][a[1]], run.blocks[j][b[1]], nbytes)
                            for j in range(2, r))
            elif ja == jb == 2:  # inside the traced block 2: inside the last block
                kept.append((run.blocks[r - 1][a[1]], run.blocks[r - 1][b[1]], nbytes))
            elif ja == 2 and b is None:  # the last block -> after the run
                kept.append((run.blocks[r - 1][a[1]], dst, nbytes))
            else:  # excluded by _valid: a run's wiring is checked before it is used
                raise RuntimeError(f"internal: edge {src} -> {dst} crosses repeated run "
                                   f"{run.blocks[0][0]}..{run.blocks[-1][-1]} unexpectedly")
        out = kept
    return out
