"""Each layer's tensor-parallel split for the strategy search, chosen by the Alpa ILP.

Pipeline position: ``planner.pricing.Pricer.splits_for`` calls ``solve_splits`` once
per tensor-parallel degree t > 1 (the Pricer caches the answer; ``choose_splits`` is the
same as a (splits, description) pair). It turns the
``ModelProfile``'s layer graph into a ``planner.tp_ilp.TPProblem``, solves it with
``ilp_tp`` and hands back one split per layer in profile order in the Pricer's format
("" = replicated, else "column", "row", "heads", "vocab") and a one-line description
for ``Plan.solver``.

What the ILP is told (one tensor-parallel group of t devices over the cluster's
``intra_node_link``, for one training step of ``samples`` samples):

- per layer, the replicated forward + backward time of ``samples`` samples, from the
  caller (the Pricer hands in its own per-layer times, so the compute formula lives in
  one place), plus the layer's optimizer update, ``cost_model.optimizer_time_s`` of its
  weights, gradients and optimizer state. A split divides both by t (Megatron-LM,
  Shoeybi et al. 2019, Sec. 3; the Pricer divides the same state by t). The update is
  what makes splitting an Embedding pay: its lookup has no FLOPs, but a replicated
  vocabulary x hidden table is read and written whole on every device each step;
- per layer, the data-parallel all-reduce of its gradient when the caller hands in
  ``grad_allreduce_s`` (the Pricer hands its own, for dp = devices / t): the marginal
  f(G) - f(0), bandwidth only (gradients are all-reduced in buckets, not one latency
  per layer), divided by t when split. It decides the Embedding at large batches: its
  gradient is ready only at the end of the backward pass, so nothing hides its
  all-reduce, while a vocab split's forward all-reduce grows with the batch;
- per layer, its own Megatron f/g all-reduces (``profiler.comm.layer_comm``) and its
  per-device memory (state / t when split, saved activations / t for a column split:
  ``tp_ilp.split_options``), all bytes scaled from the profile batch to ``samples``;
- per layer, only the splits a group of t devices can take (``profiler.comm``'s
  ``TensorSplit.allows``: a GroupQueryAttention is split by heads only when t divides
  its key/value heads); the fixed rule replicates the others too;
- per edge of the layer graph (``ModelProfile.edges``, else ``LayerProfile.inputs``
  with the producer's output bytes), the resharding collectives between differently
  laid out neighbours (``tp_ilp.RESHARDING``; Zheng et al., "Alpa", OSDI'22, Sec. 4.2);
- identical repeated blocks -- runs of at least ``profiler.repeats.MIN_REPEATS``
  consecutive blocks whose layers price the same and read their inputs from the same
  relative positions -- share one choice per block position, every other block alike
  (``SHARE_PERIOD_BLOCKS``, ``tp_ilp.block_of_runs``: one shared choice for all blocks
  could not alternate a stack of identical Dense layers column, row), so the ILP's
  size does not grow with depth.

``samples`` (``reference_samples``) is what one group processes per step when every
device of the cluster does data parallelism around it: global batch x t / devices.
The data-parallel all-reduce is charged in full, not net of the backward pass it may
overlap: it only makes splitting large layers (split anyway) more attractive. No
memory capacity is imposed by default: splits are chosen per t for every pipeline
depth, and a whole-model capacity would wrongly reject splits that fit once pipelined;
the Pricer checks each strategy's stage memory afterwards. Resharding collectives are
priced here; a cost model that prices the chosen splits adds them per layer with
``resharding_allgather_bytes`` (none for the Megatron pattern).

The answer is the ILP's unless the fixed rule (``tp_split_rule``) prices
lower by ``tp_ilp.evaluate_tp`` (possible only when the rule splits identical blocks
differently, or the time limit cut the solve short); the rule is also used, and the
description says so, when no layer can be split (the ILP has nothing to choose).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Callable, Sequence, Union

import numpy as np

from tfplan.planner import cost_model as cm
from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import SolverError
from tfplan.planner.tp_ilp import (SplitOption, TPEdge, TPLayer, TPProblem, block_of_runs,
                            evaluate_tp, ilp_tp, resharding, split_options)
from tfplan.profiler.comm import (ATTENTION_BLOCK, COLUMN_ROW_TYPES, HEAD_SPLIT_TYPES,
                                  VOCAB_SPLIT_TYPES, input_grad_bytes, layer_comm,
                                  split_kind)
from tfplan.profiler.model_profile import LayerProfile, ModelProfile
from tfplan.profiler.repeats import MIN_REPEATS

# Blocks j and j + 2 of a run share choices, j and j + 1 need not (tp_ilp.block_of_runs):
# a stack of identical Dense layers can then alternate column, row.
SHARE_PERIOD_BLOCKS = 2
# samples -> per-layer replicated forward + backward seconds (profile order); or those
# seconds already computed for ``samples``.
LayerTimes = Union[Callable[[int], Sequence[float]], Sequence[float]]


@dataclass(frozen=True)
class SplitChoice:
    """The splits the search uses at one tensor-parallel degree, and how they were found."""

    splits: tuple[str, ...]  # per layer in profile order, "" = replicated
    solver: str  # one line, for Plan.solver
    time_s: float  # tp_ilp objective of ``splits`` (per step of ``samples`` samples)
    rule_time_s: float  # the same for tp_split_rule's splits
    samples: int
    problem: TPProblem | None  # None when the ILP was not applicable


def tp_split_rule(types: tuple[str, ...], groups: Sequence[int] | None = None
                  ) -> tuple[str, ...]:
    """The split of each layer under tp > 1 ("" = replicated), by the fixed rule: Dense-like
    layers alternate column, row (the Megatron MLP pair), attention splits by heads,
    Embedding by vocabulary, everything else is replicated (Shoeybi et al., 2019, Sec. 3).
    ``groups``: per layer, ``LayerProfile.groups``; a grouped convolution (> 1) is
    replicated, as ``apply`` cannot split it."""
    out, last_dense = [], "row"
    for i, t in enumerate(types):
        if t in COLUMN_ROW_TYPES and (groups is None or groups[i] == 1):
            last_dense = "column" if last_dense == "row" else "row"
            out.append(last_dense)
        elif t in HEAD_SPLIT_TYPES or t == ATTENTION_BLOCK:
            out.append("heads")
            last_dense = "row"
        elif t in VOCAB_SPLIT_TYPES:
            out.append("vocab")
            last_dense = "row"
        else:
            out.append("")
    return tuple(out)


def reference_samples(global_batch: int, num_devices: int, tp: int) -> int:
    """Samples one tensor-parallel group of ``tp`` devices processes per step when the
    rest of the cluster is data parallel around it: max(1, B x t // N)."""
    return max(1, global_batch * tp // max(1, num_devices))


def tp_problem(profile: ModelProfile, cluster: ClusterSpec, tp: int, *,
               layer_time_s: LayerTimes, samples: int,
               memory_capacity_bytes: float | None = None,
               grad_allreduce_s: Callable[[float], float] | None = None) -> TPProblem:
    """The TPProblem of ``profile`` at degree ``tp`` for ``samples`` samples per step.

    Layers with the same numbers (all but name and inputs) and the same time share one
    options tuple, priced once: a deep model of identical blocks costs a few pricings.
    """
    layers = profile.layers
    f = samples / profile.batch_size
    times = list(layer_time_s(samples) if callable(layer_time_s) else layer_time_s)
    if len(times) != len(layers):
        raise SolverError(f"choose_splits received {len(times)} layer times for "
                          f"{len(layers)} layers; expected one per layer in profile order.")
    edges = _edges(profile, f)
    grad_in = input_grad_bytes(profile)
    base_s = grad_allreduce_s(0.0) if grad_allreduce_s else 0.0
    priced: dict[tuple, tuple[SplitOption, ...]] = {}
    tp_layers = []
    for layer, time_s in zip(layers, times):
        input_bytes = grad_in[layer.name]
        key = (_cost_fields(layer), input_bytes, float(time_s))
        if key not in priced:
            dp_s = grad_allreduce_s(layer.grad_bytes) - base_s if grad_allreduce_s else 0.0
            priced[key] = _options(layer, input_bytes, float(time_s) + dp_s, cluster, tp, f)
        tp_layers.append(TPLayer(layer.name, priced[key]))
    # a group spanning nodes (a fixed tp > devices_per_node) all-reduces over the slower
    # inter-node link: priced as a flat ring over it here (planner.pricing prices it
    # hierarchically, collectives.tensor_group_allreduce_time_s)
    link = cluster.intra_node_link if tp <= cluster.devices_per_node or \
        cluster.inter_node_link is None else cluster.inter_node_link
    return TPProblem(tuple(tp_layers), edges, tp, link,
                     memory_capacity_bytes, block_of_runs(_repeated_blocks(tp_layers, edges),
                                                   period_blocks=SHARE_PERIOD_BLOCKS))


# what a layer costs: every LayerProfile field but its name and wiring
COST_FIELDS = tuple(f.name for f in fields(LayerProfile)
                    if f.name not in ("name", "inputs", "not_counted"))
_cost_fields = attrgetter(*COST_FIELDS)


def _options(layer: LayerProfile, input_bytes: int, time_s: float, cluster: ClusterSpec,
             tp: int, f: float) -> tuple[SplitOption, ...]:
    """``tp_ilp.split_options`` with the optimizer update added and bytes scaled by f."""
    opt_s = cm.optimizer_time_s(layer.param_bytes, layer.grad_bytes, layer.optimizer_bytes,
                                cluster.device)
    options = split_options(layer, input_bytes, time_s + opt_s,
                            cm.with_margin_bytes(layer.state_bytes),
                            cm.with_margin_bytes(cm.saved_activation_bytes(layer) * f), tp)
    refused = _refused_splits(layer, tp)  # a GroupQueryAttention's heads, tp not | kv heads
    options = tuple(o for o in options if o.split not in refused)
    # layer_comm's bytes are for the profile batch; a collective without ``where`` is
    # named after its layer by evaluate_tp, so identical layers price equal
    return tuple(SplitOption(o.split, o.compute_time_s, o.memory_bytes,
                             tuple(replace(c, nbytes=c.nbytes * f, where="")
                                   for c in o.collectives)) for o in options)


def _refused_splits(layer: LayerProfile, tp: int) -> frozenset[str]:
    """The splits ``profiler.comm`` offers ``layer`` that a group of ``tp`` devices
    cannot take (``TensorSplit.allows``)."""
    return frozenset(s.split for s in layer_comm(layer, 0).tp_splits if not s.allows(tp))


def _edges(profile: ModelProfile, f: float) -> tuple[TPEdge, ...]:
    """Layer-to-layer tensors (model inputs and outputs left out), bytes for f x the
    profile batch; from ``LayerProfile.inputs`` when the profile lists no edges."""
    by_name = {l.name: l for l in profile.layers}
    if profile.edges:
        pairs = [(e.src, e.dst, e.bytes) for e in profile.edges]
    else:
        pairs = [(src, l.name, by_name[src].activation_bytes)
                 for l in profile.layers for src in l.inputs if src in by_name]
    return tuple(TPEdge(src, dst, nbytes * f) for src, dst, nbytes in pairs
                 if src in by_name and dst in by_name and src != dst)


def _repeated_blocks(layers: Sequence[TPLayer], edges: Sequence[TPEdge]
                     ) -> list[list[list[str]]]:
    """Runs of identical blocks (each a list of blocks of layer names). Two layers match
    when they share their priced options and read the same bytes from the same relative
    positions (as ``profiler.repeats`` matches layers by config and wiring)."""
    index = {l.name: i for i, l in enumerate(layers)}
    reads: list[list[tuple[int, float]]] = [[] for _ in layers]
    for e in edges:
        reads[index[e.dst]].append((index[e.dst] - index[e.src], e.nbytes))
    kinds: dict = {}
    keys = [kinds.setdefault((id(l.options), tuple(sorted(reads[i]))), len(kinds))
            for i, l in enumerate(layers)]
    return [[[layers[s + j * p + k].name for k in range(p)] for j in range(r)]
            for s, p, r in repeated_runs(keys, MIN_REPEATS)]


def repeated_runs(keys: Sequence[int], min_repeats: int = MIN_REPEATS
                  ) -> list[tuple[int, int, int]]:
    """Non-overlapping runs (start, period p, repeats r >= min_repeats) of a key sequence
    that repeats itself with period p, most layers skipped first: the rule of
    ``profiler.repeats._best_runs``, with each period's matches found by numpy.

    For period p, position i matches when keys[i] == keys[i + p]; a maximal stretch of L
    matches from i is a run of r = 1 + L // p blocks, scored (r - 3) p (the layers the
    profiler skips); runs are taken best score first (then shorter period, later start,
    more repeats), skipping any that overlaps one taken.
    """
    k = np.asarray(keys)
    n = len(k)
    periods = np.arange(1, n // min_repeats + 1)
    candidates = []
    if len(periods):
        # match[p - 1, i] = keys[i] == keys[i + p], every period at once (n^2 / 4 booleans);
        # row p of the sliding view is keys[p:] padded with a key no layer has
        padded = np.concatenate((k, np.full(len(periods) + 1, k.min() - 1)))
        ahead = np.lib.stride_tricks.sliding_window_view(padded, n)[1:len(periods) + 1]
        match = np.zeros((len(periods), n + 2), dtype=np.int8)
        match[:, 1:n + 1] = ahead == k[None, :]
        step = np.diff(match, axis=1)
        rows, starts = np.nonzero(step == 1)  # row-major: pairs up with the ends below
        _, ends = np.nonzero(step == -1)
        p = periods[rows]
        repeats = 1 + (ends - starts) // p
        keep = repeats >= min_repeats
        candidates = [((r - 3) * q, -q, i, r) for q, i, r in
                      zip(p[keep].tolist(), starts[keep].tolist(), repeats[keep].tolist())]
    taken: list[tuple[int, int]] = []
    chosen = []
    for _, neg_p, s, r in sorted(candidates, reverse=True):
        lo, hi = s, s + r * -neg_p
        if all(hi <= a or b <= lo for a, b in taken):
            taken.append((lo, hi))
            chosen.append((s, -neg_p, r))
    return sorted(chosen)


# the split of an entry inside a custom attention block split by heads as a whole: it runs
# on its rank's heads (its time and state / tp), the block's entry carries the collectives
INSIDE = "inside"


def attention_units(profile: ModelProfile, tp: int) -> dict[int, int]:
    """{index of a custom attention block's entry: index one past its last sub-entry} for
    the blocks ``profiler.comm`` splits by heads at ``tp`` (``split_kind`` is
    ``ATTENTION_BLOCK`` and tp divides their key/value heads)."""
    out, layers = {}, profile.layers
    for i, layer in enumerate(layers):
        if split_kind(layer) == ATTENTION_BLOCK and "heads" not in _refused_splits(layer, tp):
            j = i + 1
            while j < len(layers) and layers[j].name.startswith(layer.name + "/"):
                j += 1
            if j > i + 1:  # a unit of several entries (merged ones are one already)
                out[i] = j
    return out


def _merged(profile: ModelProfile, units: dict[int, int], times: Sequence[float]
            ) -> tuple[ModelProfile, tuple[float, ...]]:
    """``profile`` with each attention unit (``attention_units``) collapsed into its
    block's entry -- work, state and saved bytes summed; its input and output those of
    the block -- and the edges inside it dropped; the times summed the same way."""
    layers, merged_times, head = [], [], {}
    skip_until = 0
    for i, layer in enumerate(profile.layers):
        if i < skip_until:
            head[layer.name] = layers[-1].name
            continue
        if i in units:
            part = profile.layers[i:units[i]]
            summed = {f: sum(getattr(l, f) for l in part) for f in _SUMMED}
            layer = replace(layer, **summed)
            merged_times.append(float(sum(times[i:units[i]])))
            skip_until = units[i]
        else:
            merged_times.append(float(times[i]))
        layers.append(layer)
        head[layer.name] = layer.name
    edges = tuple(replace(e, src=head.get(e.src, e.src), dst=head.get(e.dst, e.dst))
                  for e in profile.edges if head.get(e.src, e.src) != head.get(e.dst, e.dst))
    return replace(profile, layers=tuple(layers), edges=edges), tuple(merged_times)


# what an attention unit sums over its entries (the rest are its block entry's own)
_SUMMED = ("params", "trainable_params", "param_bytes", "trainable_param_bytes", "grad_bytes",
           "optimizer_bytes", "compute_weight_bytes", "activation_saved_bytes", "flops_fwd",
           "flops_bwd", "matmul_flops_fwd", "matmul_flops_bwd", "memory_traffic_bytes_fwd",
           "memory_traffic_bytes_bwd", "attention_core_flops_fwd",
           "attention_core_saved_bytes")


def solve_splits(profile: ModelProfile, cluster: ClusterSpec, tp: int, *,
                 layer_time_s: LayerTimes, samples: int, time_limit_s: float = 10.0,
                 memory_capacity_bytes: float | None = None,
                 grad_allreduce_s: Callable[[float], float] | None = None) -> SplitChoice:
    """The splits at degree ``tp`` with their prices (see the module docstring). A custom
    attention block split by heads is decided as one unit with its sub-layers
    (``attention_units``): they get ``INSIDE`` when it is split, "" when it is not."""
    units = attention_units(profile, tp) if tp > 1 else {}
    if units:
        times = layer_time_s(samples) if callable(layer_time_s) else layer_time_s
        merged, merged_times = _merged(profile, units, list(times))
        choice = solve_splits(merged, cluster, tp, layer_time_s=merged_times, samples=samples,
                              time_limit_s=time_limit_s,
                              memory_capacity_bytes=memory_capacity_bytes,
                              grad_allreduce_s=grad_allreduce_s)
        out, k = [], 0
        i = 0
        while i < len(profile.layers):
            split = choice.splits[k]
            out.append(split)
            if i in units:
                out += [INSIDE if split else ""] * (units[i] - i - 1)
                i = units[i]
            else:
                i += 1
            k += 1
        return replace(choice, splits=tuple(out))
    rule = tp_split_rule(tuple(split_kind(l) for l in profile.layers),
                         tuple(l.groups for l in profile.layers))
    rule = tuple("" if k in _refused_splits(l, tp) else k for k, l in zip(rule, profile.layers))
    if tp == 1:
        return SplitChoice(("",) * len(profile.layers), "no tensor parallelism", 0.0, 0.0,
                           samples, None)
    problem = tp_problem(profile, cluster, tp, layer_time_s=layer_time_s, samples=samples,
                         memory_capacity_bytes=memory_capacity_bytes,
                         grad_allreduce_s=grad_allreduce_s)
    rule_plan = evaluate_tp(problem, _as_ilp(problem, rule))
    rule_time_s = rule_plan.time_s
    if all(len(l.options) == 1 for l in problem.layers):
        return SplitChoice(rule, f"tp split rule (no splittable layer: the ILP has nothing "
                           f"to choose at tp={tp})", rule_time_s, rule_time_s, samples, None)
    plan = ilp_tp(problem, time_limit_s=time_limit_s)
    groups = len({problem.block_of.get(l.name, l.name) for l in problem.layers})
    solver = (f"tp splits by ILP (Alpa intra-op, HiGHS) at tp={tp}: {groups} choice groups "
              f"for {len(problem.layers)} layers, "
              f"{'optimal' if 'optimal' in plan.solver else 'time limit reached'}")
    splits = tuple("" if k == "replicate" else k for _, k in plan.split_of_layer)
    if rule_time_s < plan.time_s and (memory_capacity_bytes is None
                                      or rule_plan.memory_bytes <= memory_capacity_bytes):
        return SplitChoice(rule, f"tp split rule at tp={tp}: it prices below the ILP's "
                           f"answer ({solver})", rule_time_s, rule_time_s, samples, problem)
    return SplitChoice(splits, solver, plan.time_s, rule_time_s, samples, problem)


def choose_splits(profile: ModelProfile, cluster: ClusterSpec, tp: int, *,
                  layer_time_s: LayerTimes, samples: int, time_limit_s: float = 10.0,
                  memory_capacity_bytes: float | None = None,
                  grad_allreduce_s: Callable[[float], float] | None = None
                  ) -> tuple[tuple[str, ...], str]:
    """Each layer's split at degree ``tp`` ("" = replicated) and a one-line description."""
    choice = solve_splits(profile, cluster, tp, layer_time_s=layer_time_s, samples=samples,
                          time_limit_s=time_limit_s,
                          memory_capacity_bytes=memory_capacity_bytes,
                          grad_allreduce_s=grad_allreduce_s)
    return choice.splits, choice.solver


def _as_ilp(problem: TPProblem, splits: Sequence[str]) -> dict[str, str]:
    """Strategies-format splits as tp_ilp's layer -> split mapping."""
    return {l.name: (k or "replicate") for l, k in zip(problem.layers, splits)}


def resharding_allgather_bytes(profile: ModelProfile, splits: Sequence[str]
                               ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per layer (profile order, profile batch): the bytes all-gathered over the group to
    bring the layer's inputs into the layout it reads (``tp_ilp.RESHARDING``), forward
    (a split output read whole) and backward (a whole output read split). The Megatron
    pattern needs none; a cost model pricing ``splits`` adds them to the layer's
    collectives (``collectives.ring_allgather_time_s``) to match the ILP."""
    index = {l.name: i for i, l in enumerate(profile.layers)}
    fwd, bwd = [0.0] * len(index), [0.0] * len(index)
    for e in _edges(profile, 1.0):
        dst = index[e.dst]
        for c in resharding(splits[index[e.src]] or "replicate", splits[dst] or "replicate",
                            e.nbytes):
            (fwd if c.direction == "forward" else bwd)[dst] += c.nbytes
    return tuple(fwd), tuple(bwd)
