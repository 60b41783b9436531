"""Mixture-of-experts layers in a profile: recognised, and priced by their routed work.

Pipeline position: inside the profiler, after the training step is traced
(``profiler.op_attribution``) and the per-entry ``LayerProfile``s are made
(``profiler.static``): ``moe_layers`` finds the MoE layers among the profiled entries,
``apply_moe`` rewrites their entries' FLOPs from what the layer as written executes to
what its routing asks for, and fills the ``LayerProfile.moe_*`` fields the planner's
expert parallelism reads. Nothing here runs a model or allocates a weight: it reads layer
objects (their weights' shapes) and the traced graph's ops, so a symbolic model
(``tf.Graph``, a trillion parameters) is priced like a small one, in Python work that
does not grow with the experts or the tokens (one pass over the layer's ops).

What is recognised (``moe_layers``):

* ``tfplan.layers.MixtureOfExperts`` (by class): one entry holds the router, the routing
  and the experts;
* any other layer by structure: a router -- a Dense sub-layer with E units, or a weight
  of its own ``[d, E]`` -- feeding a top-k choice -- an int ``top_k`` attribute, or a
  ``TopKV2`` op in its traced ops -- and experts: weights stacked ``[E, ...]`` (at least one
  of rank 3), held by one sub-layer (keras_hub 0.32's ``MixtralMoeExperts`` inside
  ``MixtralSparseMoeBlock``, ``QwenMoeExperts`` inside ``QwenSparseMoeBlock``, whose shared
  expert and its gate stay ordinary entries) or by the layer itself.

The ``moe_*`` numbers sit on the entry that holds the experts -- our layer's own entry, the
expert bank's ``block/.../experts`` entry for keras_hub's blocks -- so that on every entry
``moe_expert_params <= params`` and ``moe_expert_flops_fwd`` is part of ``flops_fwd``. The
router keeps its own entry (a Dense: 2 T d E forward, as traced); the block's routing ops
(softmax, top-k, its dense weighted sum over the experts) stay in the block's entry.

Symbols: T tokens routed per profile batch (batch x sequence, summed over calls), d model
width, E experts, k top_k, h an expert's hidden width, C rows per expert in our layer's
dispatch buffer (``tfplan.layers.routing.static_capacity``: T with no capacity factor,
ceil(cf T k / E) with one; Switch Transformer, Fedus et al. 2021, eq. 3).

The numbers (2 FLOPs per multiply-add and 1 per element-wise op, ``profiler.op_flops``):

* rows: the layer as written runs its experts on ``R_exec`` rows -- our layer E C (its
  GShard buffer, Lepikhin et al. 2020, Alg. 1, padding included), keras_hub's blocks E T
  (every expert on every token) -- read off the experts' contractions (``[E, rows, .]``
  outputs); the routing asks for ``R = min(T k, R_exec)`` rows: each token's k choices,
  less any a capacity factor below 1 must drop;
* per row forward, as ``profiler.op_flops`` counts the experts' ops: our layer
  ``4 d h + a h`` plus ``h + d`` with biases (two contractions, the activation's a
  FLOPs per element -- GELU 5: Mul, Neg, Mul, Erfc, Mul -- and the bias adds); Mixtral
  ``6 d h + (s + 1) h`` (gate, up and down contractions, SiLU s = 3: Mul, Sigmoid, Mul,
  and the gate x up product); Qwen-MoE the same with its gate and up in one ``[E, d, 2h]``
  kernel. The profiler reads it as the experts' traced forward FLOPs / R_exec (a warning
  when that does not divide: some expert op is not per row);
* ``moe_expert_flops_fwd = R x per row`` (the routed experts' forward FLOPs; Switch
  Transformer's ``T k`` expert passes); ``moe_executed_flops_fwd`` = the traced
  ``R_exec x per row`` when that is more, else 0; the entry's ``flops_fwd`` and
  ``matmul_flops_fwd`` take the routed experts' numbers in place of the executed ones;
* backward: the experts' traced backward ops (the contractions' input and weight
  gradients -- 2x their forward, Kaplan et al. 2020, Sec. 2.1 -- and the element-wise
  gradients) scaled by ``R / R_exec`` (rounded down), and so their matmul share and the
  memory traffic of both passes: every expert op is per row, but for the bias
  gradients' sums (``rows - 1`` adds per column), scaled alike;
* the top-k choice: ``TopKV2`` has no formula in ``profiler.op_flops``; in a recognised
  layer it counts ``prod(scores) - prod(chosen)`` = T (E - k) comparisons, the registry's
  reduction rule (what ``ArgMax`` counts, which it is for k = 1);
* data-dependent sizes: in a recognised layer's entries, an op whose tensors' leading
  dimension is unknown (our layer's combine gradient keeps the choices that fit) is
  counted with R / calls rows there (no choice dropped);
* ``moe_dispatch_bytes = T k d x`` the activation's bytes: one direction of the
  all-to-all of expert parallelism (GShard's dispatch; the combine carries as much back);
* ``moe_expert_params``: the stacked expert weights' elements (what expert parallelism
  divides); ``moe_capacity_factor``: our layer's (0.0: none, keras_hub's blocks).

A layer with a ``TopKV2`` op and stacked ``[E, ...]`` weights that is not recognised gets a
warning in the profile naming it and what was missing; its FLOPs are its ops as written.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from tfplan.profiler.model_profile import LayerProfile
from tfplan.profiler.op_attribution import op_info, traffic_bytes
from tfplan.profiler.op_flops import count_op, is_matmul, prod

TOP_K_OPS = ("TopKV2", "TopK")
_CONTRACTIONS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
_GRAD = "_grad/"


@dataclass(frozen=True)
class MoeLayer:
    """Where a recognised mixture of experts sits among the profiled entries."""

    routing_entry: str  # the entry whose ops choose the top k (the layer itself)
    router_entry: str  # the entry holding the router's contraction
    expert_entry: str  # the entry holding the stacked expert weights (gets the moe_* fields)
    experts: int  # E
    top_k: int  # k; 0: read from the TopKV2 op
    expert_params: int
    expert_shapes: tuple[tuple[int, ...], ...]  # shapes of the stacked expert weights
    capacity_factor: float  # 0.0: none
    whole_entry: bool  # every op of expert_entry is an expert op (a separate expert bank)


# --- recognition ----------------------------------------------------------------------------
def _shape(w: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in w.shape)


def _stacked(weights: Sequence[Any]) -> int | None:
    """E when ``weights`` are all stacked ``[E, ...]`` with at least one of rank 3."""
    ranks3 = {_shape(w)[0] for w in weights if len(w.shape) >= 3}
    if len(ranks3) != 1:
        return None
    e = ranks3.pop()
    return e if all(len(w.shape) >= 2 and _shape(w)[0] == e for w in weights) else None


def _int_attr(layer: Any, name: str) -> int:
    value = getattr(layer, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def moe_layers(paths: Sequence[tuple[str, Any]]) -> tuple[list[MoeLayer], dict[str, str]]:
    """The recognised MoE layers among ``paths`` (``profiler.signature.profiled_layer_paths``),
    and {entry: what is missing} for layers holding stacked expert-like weights that are
    not recognised (``suspect_warnings`` words them once the trace shows a top-k)."""
    from tfplan.layers import MixtureOfExperts
    from tfplan.profiler.signature import keras_base_type, own_weights, sublayers

    key_of = {id(layer): key for key, layer in paths}
    found: list[MoeLayer] = []
    missing: dict[str, str] = {}
    inside: set[int] = set()  # expert banks already claimed by a recognised layer
    for key, layer in paths:
        if isinstance(layer, MixtureOfExperts):
            experts = [w for w in layer.expert_weights() if w is not None]
            found.append(MoeLayer(
                key, key, key, layer.num_experts, layer.top_k,
                sum(prod(_shape(w)) for w in experts), tuple(_shape(w) for w in experts),
                float(layer.capacity_factor or 0.0), whole_entry=False))
            continue
        own = own_weights(layer)
        subs = sublayers(layer)
        holders = []
        e_own = {_shape(w)[0] for w in own if len(w.shape) >= 3}
        if len(e_own) == 1:  # the own weights stacked [E, ...] (a router [d, E] aside)
            e0 = next(iter(e_own))
            stacked = [w for w in own if len(w.shape) >= 2 and _shape(w)[0] == e0]
            holders.append((key, stacked, False))
        holders += [(key_of[id(s)], list(s.weights), True) for s in subs
                    if id(s) in key_of and s.weights and _stacked(list(s.weights))
                    and not sublayers(s)]
        if not holders:
            continue
        entry, weights, whole = holders[0]
        e = _stacked(weights)
        routers = [key_of[id(s)] for s in subs if id(s) in key_of
                   and keras_base_type(s) == "Dense" and getattr(s, "units", None) == e]
        if not routers and any(len(w.shape) == 2 and _shape(w)[1] == e for w in own):
            routers = [key]
        if not routers:
            if id(layer) not in inside:
                missing[key] = (f"no router: neither a Dense sub-layer with {e} units nor a "
                                f"weight of its own [d, {e}]")
            continue
        inside.update(id(s) for s in subs)
        found.append(MoeLayer(key, routers[0], entry, e, _int_attr(layer, "top_k"),
                              sum(prod(_shape(w)) for w in weights),
                              tuple(_shape(w) for w in weights), 0.0, whole))
    claimed = {m.expert_entry for m in found} | {m.routing_entry for m in found}
    return found, {k: v for k, v in missing.items() if k not in claimed}


# --- the trace ------------------------------------------------------------------------------
@dataclass
class _Ops:
    """One entry's traced ops: (record, graph op) per pass, in creation order."""

    fwd: list[tuple[Any, Any]]
    bwd: list[tuple[Any, Any]]


def ops_by_entry(trace: Any, wanted: set[str]) -> dict[str, _Ops]:
    """{entry: its traced forward and backward ops} for the ``wanted`` entries (one pass
    over the trace)."""
    out: dict[str, _Ops] = {}
    graph = trace.graph
    for r in trace.ops:
        if r.owner not in wanted or r.phase == "loss":
            continue
        ops = out.setdefault(r.owner, _Ops([], []))
        (ops.bwd if r.phase == "bwd" else ops.fwd).append((r, graph.get_operation_by_name(r.name)))
    return out


def _out_shape(op: Any) -> tuple | None:
    if not op.outputs or op.outputs[0].shape.rank is None:
        return None
    return tuple(op.outputs[0].shape.as_list())


def _forward_of(name: str) -> Iterable[str]:
    """The forward op names a gradient op's name may derive from (``<scope>/<fwd>_grad/...``),
    innermost first."""
    rest = name.split("/", 1)[1] if "/" in name else name
    at = len(rest)
    while True:
        at = rest.rfind(_GRAD, 0, at)
        if at < 0:
            return
        yield rest[:at]


def _expert_ops(m: MoeLayer, ops: _Ops) -> tuple[list, list]:
    """(forward, backward) (record, op) pairs of the experts in ``m.expert_entry``."""
    if m.whole_entry:
        return ops.fwd, ops.bwd
    shapes = set(m.expert_shapes)
    fwd_names: set[str] = set()
    fwd = []
    for r, op in ops.fwd:
        shape = _out_shape(op)
        if shape is None or len(shape) < 2 or shape[0] != m.experts:
            continue
        reads = op.type == "ReadVariableOp" and shape in shapes
        if reads or any(t.op.name in fwd_names for t in op.inputs):
            fwd_names.add(op.name)
            fwd.append((r, op))
    bwd_names: set[str] = set()
    bwd = []
    for r, op in ops.bwd:
        derived = list(_forward_of(op.name))
        if any(f in fwd_names for f in derived) or (
                not derived and any(t.op.name in bwd_names for t in op.inputs)):
            bwd_names.add(op.name)
            bwd.append((r, op))
    return fwd, bwd


def _rows(pairs: Sequence[tuple[Any, Any]], experts: int, kernels: int) -> int:
    """Rows the experts run on: their contractions' ``[E, rows, .]`` outputs / kernels."""
    total = 0
    for _, op in pairs:
        shape = _out_shape(op)
        if (op.type in _CONTRACTIONS and len(op.inputs) >= 2 and shape and len(shape) >= 3
                and shape[0] == experts and None not in shape[:-1]):
            total += prod(shape[:-1])
    return total // max(kernels, 1)


def _tokens(pairs: Sequence[tuple[Any, Any]], experts: int, exclude: set[str]
            ) -> tuple[int, int]:
    """(T, activation bytes per element) from the router's contractions ([T, E] outputs)."""
    tokens, size = 0, 0
    for _, op in pairs:
        shape = _out_shape(op)
        if (op.type in _CONTRACTIONS and op.name not in exclude and shape and len(shape) >= 2
                and shape[-1] == experts and None not in shape):
            tokens += prod(shape[:-1])
            size = size or op.inputs[0].dtype.size
    return tokens, size


def _top_k(pairs: Sequence[tuple[Any, Any]]) -> tuple[list[Any], int]:
    """The top-k ops among ``pairs`` and their k (0 when not static)."""
    import tensorflow as tf

    ops = [op for _, op in pairs if op.type in TOP_K_OPS]
    k = 0
    for op in ops:
        value = tf.get_static_value(op.inputs[1]) if op.type == "TopKV2" else \
            op.get_attr("k")
        k = k or (int(value) if value is not None else 0)
    return ops, k


@dataclass(frozen=True)
class _Scaled:
    flops_fwd: int
    flops_bwd: int
    matmul_fwd: int
    matmul_bwd: int
    traffic_fwd: int
    traffic_bwd: int


def _sums(fwd: Sequence, bwd: Sequence, float_size: int | None) -> _Scaled:
    def matmul(pairs: Sequence) -> int:
        return sum(r.flops for r, op in pairs if is_matmul(op_info(op)))

    def moved(pairs: Sequence) -> int:
        return sum(traffic_bytes(op, float_size) for r, op in pairs
                   if not is_matmul(op_info(op)))

    return _Scaled(sum(r.flops for r, _ in fwd), sum(r.flops for r, _ in bwd), matmul(fwd),
                   matmul(bwd), moved(fwd), moved(bwd))


def _recount(op: Any, rows: int) -> int | None:
    """``op``'s FLOPs with its unknown leading dimensions set to ``rows``; None if some
    other dimension is unknown too."""
    info = op_info(op)

    def fill(shape: tuple | None) -> tuple | None:
        if shape is None or not shape:
            return shape
        return (rows if shape[0] is None else shape[0],) + tuple(shape[1:])

    filled = dataclasses.replace(info, input_shapes=tuple(fill(s) for s in info.input_shapes),
                                 output_shapes=tuple(fill(s) for s in info.output_shapes))
    count = count_op(filled)
    return None if count.problem else count.flops


def _drop(not_counted: Sequence[str], names: set[str]) -> tuple[str, ...]:
    """``not_counted`` without the entries about ops in ``names`` (also "(as src) ...")."""
    def about(entry: str) -> bool:
        text = entry.split(") ", 1)[1] if entry.startswith("(as ") else entry
        return text.split(" (", 1)[0] in names

    return tuple(e for e in not_counted if not about(e))


# --- the profile ----------------------------------------------------------------------------
def apply_moe(layers: Mapping[str, LayerProfile], found: Sequence[MoeLayer], trace: Any,
              sources: Mapping[str, str], float_size: int | None = None
              ) -> tuple[dict[str, LayerProfile], list[str]]:
    """``layers`` (by entry) with each recognised MoE priced by its routed work (module
    docstring), and warnings. ``sources``: the entry whose trace a repeated block's entry
    copies (``profiler.repeats``); ``float_size``: bytes per floating-point element when
    the profile prices activations in another dtype than the traced one."""
    out = dict(layers)
    warnings: list[str] = []
    by_entry = ops_by_entry(trace, {sources.get(key, key) for m in found for key in (
        m.routing_entry, m.router_entry, m.expert_entry)}) if found else {}
    empty = _Ops([], [])
    for m in found:
        def ops(key: str) -> _Ops:
            return by_entry.get(sources.get(key, key), empty)

        expert_ops, routing_ops = ops(m.expert_entry), ops(m.routing_entry)
        fwd, bwd = _expert_ops(m, expert_ops)
        kernels = sum(1 for s in m.expert_shapes if len(s) >= 3)
        executed_rows = _rows(fwd, m.experts, kernels)
        tokens, size = _tokens(ops(m.router_entry).fwd, m.experts, {op.name for _, op in fwd})
        top, k_traced = _top_k(routing_ops.fwd)
        k = m.top_k or k_traced
        entry = out[m.expert_entry]
        if not (top or m.top_k):  # no top-k choice: a soft (dense) mixture, priced as written
            continue
        if not (executed_rows and tokens and k):
            what = ("the experts' contractions ([E, rows, .] outputs)" if not executed_rows
                    else "the router's contraction ([T, E] output)" if not tokens
                    else "a static top_k")
            warnings.append(
                f"mixture of experts {m.routing_entry}: {what} not found in its traced ops; "
                f"expected {m.experts} experts with stacked weights {list(m.expert_shapes)}. "
                "Its FLOPs are its ops as written and it has no moe_* numbers; give the layer "
                "static shapes (a fixed --input-shape) and an int top_k attribute.")
            continue
        executed = _sums(fwd, bwd, float_size)
        routed_rows = min(tokens * k, executed_rows)
        per_row, rest = divmod(executed.flops_fwd, executed_rows)
        if rest:
            warnings.append(
                f"mixture of experts {m.routing_entry}: its experts' traced forward FLOPs "
                f"({executed.flops_fwd}) are not a whole number per row over {executed_rows} "
                "rows (some expert op is not per row); its routed FLOPs are scaled from them.")

        def scale(value: int) -> int:
            return value * routed_rows // executed_rows

        routed_fwd = per_row * routed_rows if not rest else scale(executed.flops_fwd)
        per_call = routed_rows // max(entry.calls, 1)
        for key in dict.fromkeys((m.expert_entry, m.routing_entry)):
            out[key] = _count_uncounted(out[key], ops(key), top if key == m.routing_entry
                                        else [], per_call)
        entry = out[m.expert_entry]
        executed_fwd = executed.flops_fwd
        out[m.expert_entry] = dataclasses.replace(
            entry,
            flops_fwd=entry.flops_fwd - executed_fwd + routed_fwd,
            flops_bwd=entry.flops_bwd - executed.flops_bwd + scale(executed.flops_bwd),
            matmul_flops_fwd=entry.matmul_flops_fwd - executed.matmul_fwd
            + scale(executed.matmul_fwd),
            matmul_flops_bwd=entry.matmul_flops_bwd - executed.matmul_bwd
            + scale(executed.matmul_bwd),
            memory_traffic_bytes_fwd=entry.memory_traffic_bytes_fwd - executed.traffic_fwd
            + scale(executed.traffic_fwd),
            memory_traffic_bytes_bwd=entry.memory_traffic_bytes_bwd - executed.traffic_bwd
            + scale(executed.traffic_bwd),
            moe_experts=m.experts, moe_top_k=k, moe_expert_params=m.expert_params,
            moe_capacity_factor=m.capacity_factor, moe_tokens=tokens,
            moe_dispatch_bytes=tokens * k * _width(m) * (float_size or size),
            moe_expert_flops_fwd=routed_fwd,
            moe_executed_flops_fwd=executed_fwd if executed_fwd > routed_fwd else 0,
            opaque=MOE_OPAQUE.format(e=m.experts) if entry.opaque else "")
    return out, warnings


# what a recognised MoE's entry says instead of the generic "multiplies weights it holds
# itself" note: the planner splits it by experts, not by tensor parallelism
MOE_OPAQUE = ("mixture of {e} experts: split by experts under expert parallelism (--fix "
              "ep=N, ep dividing {e}); no tensor-parallel split of its experts, so it is "
              "replicated under tensor parallelism")


def _count_uncounted(layer: LayerProfile, ops: _Ops, top: Sequence[Any], rows: int
                     ) -> LayerProfile:
    """``layer`` with the ops of a recognised MoE that ``profiler.op_flops`` leaves
    uncounted counted (module docstring): the ``top`` top-k ops, T (E - k) each, and ops
    whose leading dimension is unknown, at ``rows`` rows."""
    add, dropped = [0, 0], set()
    for op in top:
        info = op_info(op)
        scores, chosen = info.input_shapes[0], info.output_shapes[0]
        if scores is None or chosen is None or None in scores or None in chosen:
            continue
        add[0] += prod(scores) - prod(chosen)
        dropped.add(op.name)
    for phase, pairs in ((0, ops.fwd), (1, ops.bwd)):
        for r, op in pairs:
            if r.problem and "not fully defined" in r.problem:
                flops = _recount(op, rows)
                if flops is not None:
                    add[phase] += flops
                    dropped.add(op.name)
    return dataclasses.replace(layer, flops_fwd=layer.flops_fwd + add[0],
                               flops_bwd=layer.flops_bwd + add[1],
                               not_counted=_drop(layer.not_counted, dropped))


def _width(m: MoeLayer) -> int:
    """d: the width the experts read (the contracted axis of their first kernel)."""
    first = next(s for s in m.expert_shapes if len(s) >= 3)
    return first[1]


def suspect_warnings(missing: Mapping[str, str], trace: Any,
                     sources: Mapping[str, str]) -> list[str]:
    """A warning per layer with stacked expert-like weights and a top-k op that is not
    recognised as a mixture of experts (``moe_layers``' ``missing``)."""
    if not missing:
        return []
    owners = {r.owner for r in trace.ops if r.type in TOP_K_OPS and r.phase == "fwd"}
    return [f"layer {key} looks like a mixture of experts (a top-k op and stacked [E, ...] "
            f"weights) but is not recognised: {why}. Its FLOPs are its ops as written (all "
            "experts, if it computes them all) and it has no moe_* numbers; use "
            "tfplan.layers.MixtureOfExperts, or give it a router the profiler recognises "
            "(profiler.moe)."
            for key, why in missing.items() if sources.get(key, key) in owners]
