"""Choosing each layer's tensor-parallel split: the Alpa intra-operator ILP, brute force, re-check.

Pipeline position: for a tensor-parallel degree t, ``planner.tp_splits`` (called by
the search's ``pricing.Pricer.splits_for``) prices every layer under each split it
admits (compute time and per-device memory from the cost model, the layer's own
collectives from ``profiler.comm``), hands a ``TPProblem`` to ``ilp_tp`` and gets back
a ``TPPlan``. ``brute_force_tp`` answers the same problem for tiny graphs (tests).
Every answer goes through ``check_tp`` before anyone sees it (scipy issue 24141).

The problem (Zheng et al., "Alpa", OSDI'22, Sec. 4.2): pick one split per layer
minimising  sum_v (compute_time[v, k] + collective_time[v, k])
          + sum_(u,v) resharding_time[u, v, k_u, k_v]
subject to sum_v memory[v, k_v] <= capacity (per device).

Splits and layouts (Shoeybi et al., "Megatron-LM", 2019, Sec. 3). A split says
what layout a layer's output has and what layout it reads its input in:

    split      reads input   output layout        own collectives (profiler.comm)
    replicate  R             R                    none
    column     R             S (last axis split)  backward all-reduce of dX (operator f)
    row        S             R                    forward all-reduce of Y (operator g)
    heads      R             R                    fwd all-reduce of Y, bwd of dX
    vocab      R (token ids) R                    forward all-reduce of Y

Column and row are offered for ``profiler.comm.COLUMN_ROW_TYPES``: Dense, EinsumDense
and the channels-last convolutions, whose S layout cuts the channel axis (the last one),
so the same layouts and resharding rules hold for them; not for a grouped convolution
(``LayerProfile.groups`` > 1), which ``apply`` does not split: it stays replicated.

Resharding on an edge u -> v depends only on (output layout of u, input layout of v),
for the edge's tensor of n bytes (``RESHARDING``):

    R -> R   nothing
    S -> S   nothing (column -> row: the Megatron MLP pair)
    S -> R   forward all-gather of n bytes; backward: the gradient arrives whole and
             each device keeps its slice (free). Megatron's gather_from_..._region.
    R -> S   forward: each device slices its part (free); backward: the slices of the
             input gradient are all-gathered (n bytes). Megatron's scatter_to_..._region.

Identical repeated blocks share variables: ``TPProblem.block_of`` maps a layer to
(block key, position in block); all layers with the same pair choose the same split
(as Alpa does for repeated layers), so the ILP's size does not grow with depth.
Brute force enumerates over the same shared choices.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field as dc_field
from typing import Iterable, Mapping, Sequence

from tfplan.core.cluster import LinkSpec
from tfplan.core.errors import InfeasiblePlanError, SolverError
from tfplan.planner.collectives import ring_allgather_time_s, ring_allreduce_time_s
from tfplan.planner.milp import HIGHS, Milp, lin, pick_one, size_text
from tfplan.profiler.comm import layer_comm
from tfplan.profiler.model_profile import LayerProfile

SPLITS = ("replicate", "column", "row", "heads", "vocab")
INPUT_LAYOUT = {"replicate": "R", "column": "R", "row": "S", "heads": "R", "vocab": "R",
                "inside": "R"}
OUTPUT_LAYOUT = {"replicate": "R", "column": "S", "row": "R", "heads": "R", "vocab": "R",
                 "inside": "R"}
# "inside": an entry within an attention block split by heads as a whole
# (``planner.tp_splits.INSIDE``): it runs on its rank's heads, its block's collectives
# bring its inputs and outputs to and from the rest of the model
# (producer output layout, consumer input layout) -> collectives on the edge's tensor,
# as (kind, direction). Megatron-LM Sec. 3 (f, g and the gather/scatter regions); Alpa
# Sec. 4.2 (resharding cost on edges between differently laid out operators).
RESHARDING: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("R", "R"): (),
    ("S", "S"): (),
    ("S", "R"): (("all-gather", "forward"),),
    ("R", "S"): (("all-gather", "backward"),),
}
_FREE = {pair for pair, colls in RESHARDING.items() if not colls}
_MEMORY_SLACK = 1e-6  # as in pipeline_ilp: HiGHS's row tolerance cannot overflow memory
_TIME_SCALE = 1000.0
_BRUTE_FORCE_MAX_CHOICES = 200_000


@dataclass(frozen=True)
class Collective:
    """One collective over the tensor-parallel group: what, which pass, payload bytes."""

    kind: str  # "all-reduce" or "all-gather"
    direction: str  # "forward" or "backward"
    nbytes: float
    where: str = ""  # layer name or "u->v" for a resharding

    def time_s(self, degree: int, link: LinkSpec) -> float:
        if self.kind == "all-reduce":
            return ring_allreduce_time_s(self.nbytes, degree, link)
        if self.kind == "all-gather":
            return ring_allgather_time_s(self.nbytes, degree, link)
        raise SolverError(f"Collective kind {self.kind!r}; expected all-reduce or all-gather.")


@dataclass(frozen=True)
class SplitOption:
    """One candidate split of one layer, priced for one device of the group."""

    split: str  # one of SPLITS
    compute_time_s: float  # forward + backward on one device
    memory_bytes: float  # per device, margin included
    collectives: tuple[Collective, ...] = ()  # the layer's own (profiler.comm)


@dataclass(frozen=True)
class TPLayer:
    name: str
    options: tuple[SplitOption, ...]


@dataclass(frozen=True)
class TPEdge:
    src: str
    dst: str
    nbytes: float  # the tensor u sends v (its gradient, same size, comes back)


@dataclass(frozen=True)
class TPProblem:
    layers: tuple[TPLayer, ...]
    edges: tuple[TPEdge, ...]
    degree: int  # tensor-parallel group size t
    link: LinkSpec  # the link the group talks over
    memory_capacity_bytes: float | None = None
    # layer name -> (block key, position in the block); same pair, same split.
    block_of: Mapping[str, tuple[str, int]] = dc_field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [l.name for l in self.layers]
        if len(set(names)) != len(names):
            raise SolverError("TPProblem: layer names must be unique; received "
                              f"{sorted(n for n in names if names.count(n) > 1)} twice.")
        if self.degree < 1:
            raise SolverError(f"TPProblem: degree is {self.degree}; expected >= 1.")
        for layer in self.layers:
            if not layer.options:
                raise SolverError(f"TPProblem: layer {layer.name!r} has no split options; "
                                  "expected at least 'replicate'.")
            splits = [o.split for o in layer.options]
            bad = [s for s in splits if s not in SPLITS]
            if bad or len(set(splits)) != len(splits):
                raise SolverError(f"TPProblem: layer {layer.name!r} has splits {splits}; "
                                  f"expected distinct names from {SPLITS}.")
        known = set(names)
        for e in self.edges:
            if e.src not in known or e.dst not in known or e.src == e.dst:
                raise SolverError(f"TPProblem: edge {e.src!r} -> {e.dst!r} must join two "
                                  "different layers of the problem.")
        for key in self.block_of:
            if key not in known:
                raise SolverError(f"TPProblem: block_of names layer {key!r}, not in the problem.")


@dataclass(frozen=True)
class TPPlan:
    split_of_layer: tuple[tuple[str, str], ...]  # (layer name, split), in problem order
    compute_time_s: float
    collective_time_s: float  # the layers' own collectives
    resharding_time_s: float
    memory_bytes: float  # per device
    collectives: tuple[Collective, ...]  # every collective the plan runs (own + resharding)
    solver: str

    @property
    def time_s(self) -> float:
        return self.compute_time_s + self.collective_time_s + self.resharding_time_s

    def split(self, layer: str) -> str:
        return dict(self.split_of_layer)[layer]


def split_options(layer: LayerProfile, input_bytes: int, time_s: float, state_bytes: float,
                  activation_bytes: float, degree: int) -> tuple[SplitOption, ...]:
    """A layer's candidate splits at degree t, from its replicated cost.

    ``time_s``, ``state_bytes`` and ``activation_bytes`` are what one replica costs
    (cost model, margin included). A split divides compute and weight/gradient/
    optimizer state by t (Megatron-LM Sec. 3); a column split's output is split too,
    every other output is whole. Its own collectives are ``profiler.comm``'s.
    """
    options = [SplitOption("replicate", time_s, state_bytes + activation_bytes)]
    if layer.groups > 1:  # apply.sharded_layers splits convolutions with groups=1 only
        return tuple(options)
    for ts in layer_comm(layer, input_bytes).tp_splits:
        own = tuple(Collective("all-reduce", direction, float(n), layer.name)
                    for direction, n in (("forward", ts.fwd_allreduce_bytes),
                                         ("backward", ts.bwd_allreduce_bytes)) if n)
        act = activation_bytes / degree if ts.split == "column" else activation_bytes
        options.append(SplitOption(ts.split, time_s / degree, state_bytes / degree + act, own))
    return tuple(options)


def block_of_runs(runs: Iterable[Sequence[Sequence[str]]], period_blocks: int = 1
                  ) -> dict[str, tuple[str, int]]:
    """``TPProblem.block_of`` for runs of identical blocks, each run a sequence of blocks
    of layer names (``profiler.repeats.RepeatRun.blocks``): position i of blocks j and j'
    of run r share a key when j = j' mod ``period_blocks``; the key is
    ("run r", (j mod period_blocks) x block length + i).

    ``period_blocks=2`` lets neighbouring blocks differ while the ILP's size stays flat:
    a block whose output layout differs from its input layout (one column-split Dense of
    a stack of identical Dense layers) can then pair with the next (column, row: the
    Megatron MLP pair), which one shared choice for every block cannot.
    """
    if period_blocks < 1:
        raise SolverError(f"block_of_runs: period_blocks is {period_blocks}; expected >= 1.")
    block_of: dict[str, tuple[str, int]] = {}
    for r, blocks in enumerate(runs):
        for j, block in enumerate(blocks):
            for i, name in enumerate(block):
                block_of[name] = (f"run {r}", (j % period_blocks) * len(block) + i)
    return block_of


# --- evaluating and re-checking ---------------------------------------------------------------

def resharding(src_split: str, dst_split: str, nbytes: float,
               where: str = "") -> tuple[Collective, ...]:
    """The collectives an edge needs between a producer and a consumer split (RESHARDING)."""
    pair = (OUTPUT_LAYOUT[src_split], INPUT_LAYOUT[dst_split])
    return tuple(Collective(kind, direction, nbytes, where) for kind, direction in RESHARDING[pair])


def _option(layer: TPLayer, split: str) -> SplitOption:
    for o in layer.options:
        if o.split == split:
            return o
    raise SolverError(f"Layer {layer.name!r} has no split {split!r}; it admits "
                      f"{[o.split for o in layer.options]}.")


def evaluate_tp(problem: TPProblem, splits: Mapping[str, str], solver: str = "") -> TPPlan:
    """Time, memory and collectives of one choice of split per layer."""
    compute = own = reshard = memory = 0.0
    collectives: list[Collective] = []
    priced: dict[tuple[str, str, float], float] = {}  # collective time by (kind, pass, bytes)

    def time_s(c: Collective) -> float:
        key = (c.kind, c.direction, c.nbytes)
        if key not in priced:
            priced[key] = c.time_s(problem.degree, problem.link)
        return priced[key]

    for layer in problem.layers:
        o = _option(layer, splits[layer.name])
        compute += o.compute_time_s
        memory += o.memory_bytes
        for c in o.collectives:
            own += time_s(c)
            collectives.append(c if c.where else
                               Collective(c.kind, c.direction, c.nbytes, layer.name))
    for e in problem.edges:
        if (OUTPUT_LAYOUT[splits[e.src]], INPUT_LAYOUT[splits[e.dst]]) in _FREE:
            continue
        for c in resharding(splits[e.src], splits[e.dst], e.nbytes, f"{e.src}->{e.dst}"):
            reshard += time_s(c)
            collectives.append(c)
    return TPPlan(split_of_layer=tuple((l.name, splits[l.name]) for l in problem.layers),
                  compute_time_s=compute, collective_time_s=own, resharding_time_s=reshard,
                  memory_bytes=memory, collectives=tuple(collectives), solver=solver)


def check_tp(problem: TPProblem, splits: Mapping[str, str], solver: str = "the solver") -> TPPlan:
    """Re-check a choice against every constraint; SolverError names the first broken one."""
    for layer in problem.layers:
        if layer.name not in splits:
            raise SolverError(f"{solver} chose no split for layer {layer.name!r}.")
        if splits[layer.name] not in [o.split for o in layer.options]:
            raise SolverError(f"{solver} chose split {splits[layer.name]!r} for layer "
                              f"{layer.name!r}; it admits {[o.split for o in layer.options]}.")
    for name, group in _groups(problem).items():
        chosen = {splits[n] for n in group}
        if len(chosen) > 1:
            raise SolverError(f"{solver} split the identical layers {group} of block position "
                              f"{name} differently ({sorted(chosen)}); they must match.")
    plan = evaluate_tp(problem, splits, solver)
    cap = problem.memory_capacity_bytes
    if cap is not None and plan.memory_bytes > cap:
        raise SolverError(f"{solver} returned splits needing {plan.memory_bytes:.0f} bytes per "
                          f"device, over the {cap:.0f}-byte capacity.")
    return plan


def _groups(problem: TPProblem) -> dict:
    """Shared-choice key -> the layers that share it (in problem order)."""
    groups: dict = {}
    for layer in problem.layers:
        key = (("block", *problem.block_of[layer.name]) if layer.name in problem.block_of
               else ("layer", layer.name))
        groups.setdefault(key, []).append(layer.name)
    by_name = {l.name: l for l in problem.layers}
    for key, group in groups.items():
        first = by_name[group[0]]
        for other in group[1:]:
            theirs = by_name[other].options
            if theirs is not first.options and theirs != first.options:
                raise SolverError(
                    f"TPProblem: layers {first.name!r} and {other!r} share block position "
                    f"{key[1:]} but are priced differently; identical blocks must have "
                    "identical options.")
    return groups


def _label(group: tuple) -> str:
    """A group key as a row label: the layer name, or block[position]."""
    return group[1] if group[0] == "layer" else f"{group[1]}[{group[2]}]"


# --- the ILP ------------------------------------------------------------------------------------

def ilp_tp(problem: TPProblem, *, time_limit_s: float = 10.0) -> TPPlan:
    """The best choice of splits by ILP (scipy.optimize.milp / HiGHS), re-checked.

    Variables (g ranges over shared-choice groups: a layer, or a block position)
      s[g, k]        binary     group g uses split k
      e[g, h, k, l]  in [0, 1]  = s[g, k] * s[h, l], for each pair (g, h) joined by an edge
    Constraints
      one[g]             sum_k s[g, k] = 1
      link_out[g,h,k]    sum_l e[g, h, k, l] = s[g, k]   (the tight linearisation:
      link_in[g,h,l]     sum_k e[g, h, k, l] = s[h, l]    e is the product for 0/1 s)
      memory             sum_g sum_k count(g) mem[g, k] s[g, k] <= capacity
    Objective
      sum_g sum_k count(g) (compute + own collectives)[g, k] s[g, k]
      + sum_(g,h) sum_(k,l) (resharding summed over the edges g -> h)[k, l] e[g, h, k, l]
    An edge inside one group (g == h) prices resharding[k, k] on s[g, k].
    """
    groups = _groups(problem)
    group_of = {n: g for g, members in groups.items() for n in members}
    by_name = {l.name: l for l in problem.layers}
    rep = {g: by_name[members[0]] for g, members in groups.items()}
    t, link = problem.degree, problem.link

    def own_time_s(o: SplitOption) -> float:
        return o.compute_time_s + sum(c.time_s(t, link) for c in o.collectives)

    def reshard_s(a: str, b: str, nbytes: float) -> float:
        return sum(c.time_s(t, link) for c in resharding(a, b, nbytes))

    # Per group: multiplicity-weighted node cost and memory; per group pair: edge cost.
    node_cost = {(g, o.split): len(groups[g]) * own_time_s(o)
                 for g in groups for o in rep[g].options}
    node_mem = {(g, o.split): len(groups[g]) * o.memory_bytes
                for g in groups for o in rep[g].options}
    # Group pair -> {tensor bytes: how many edges}: repeated blocks repeat their sizes, so
    # pricing an edge family costs O(distinct sizes), not O(depth).
    pair_bytes: dict[tuple, Counter] = {}
    for edge in problem.edges:
        pair_bytes.setdefault((group_of[edge.src], group_of[edge.dst]), Counter())[edge.nbytes] += 1
    splits_of = {g: [o.split for o in rep[g].options] for g in groups}
    edge_cost = {}
    for (g, h), sizes in pair_bytes.items():
        for a in splits_of[g]:
            for b in splits_of[h]:
                if g == h and a != b:
                    continue
                cost = sum(count * reshard_s(a, b, n) for n, count in sizes.items())
                if g == h:
                    node_cost[g, a] += cost
                else:
                    edge_cost[g, h, a, b] = cost
    worst = sum(max(node_cost[g, k] for k in splits_of[g]) for g in groups) + \
        sum(edge_cost.values())
    unit_s = worst / _TIME_SCALE if worst > 0 else 1.0

    m = Milp()
    s = m.family(((g, k) for g in groups for k in splits_of[g]), lower=0, upper=1, integer=True)
    e = m.family(edge_cost, lower=0, upper=1, integer=False)
    m.minimise({s[key]: c / unit_s for key, c in node_cost.items()})
    m.minimise({e[key]: c / unit_s for key, c in edge_cost.items()})

    for g in groups:
        m.constrain(f"one[{_label(g)}]", lin([(s[g, k], 1.0) for k in splits_of[g]]), 1, 1)
    for (g, h) in (pair for pair in pair_bytes if pair[0] != pair[1]):
        for a in splits_of[g]:
            m.constrain(f"link_out[{_label(g)},{_label(h)},{a}]", lin(
                [(e[g, h, a, b], 1.0) for b in splits_of[h]], [(s[g, a], -1.0)]), 0, 0)
        for b in splits_of[h]:
            m.constrain(f"link_in[{_label(g)},{_label(h)},{b}]", lin(
                [(e[g, h, a, b], 1.0) for a in splits_of[g]], [(s[h, b], -1.0)]), 0, 0)
    cap = problem.memory_capacity_bytes
    if cap is not None:
        norm = max(cap, 1.0)
        m.constrain("memory", {s[key]: b / norm for key, b in node_mem.items()},
                    hi=cap / norm * (1 - _MEMORY_SLACK))

    name = f"ILP ({HIGHS})"
    res = m.solve_or_raise(time_limit_s, name=name, what="tensor-parallel splits",
                           infeasible=lambda: _explain_infeasible(problem))
    chosen = {}
    for g in groups:
        best = pick_one(res.x, {k: s[g, k] for k in splits_of[g]},
                        f"{name} returned a fractional split for {groups[g]}")
        for n in groups[g]:
            chosen[n] = best
    status = "optimal" if res.status == 0 else "time limit reached, best found"
    plan = check_tp(problem, chosen, f"{name}: {status}, degree {t}, {len(groups)} choice groups")
    if plan.time_s > res.fun * unit_s * (1 + 1e-6) + 1e-12:
        raise SolverError(f"{name} reported {res.fun * unit_s:.6g} s but its splits take "
                          f"{plan.time_s:.6g} s.")
    return plan


# --- brute force (tiny inputs, tests) ----------------------------------------------------------

def brute_force_tp(problem: TPProblem) -> TPPlan:
    """The best choice by enumerating every split of every shared-choice group."""
    groups = _groups(problem)
    by_name = {l.name: l for l in problem.layers}
    options = [[o.split for o in by_name[members[0]].options] for members in groups.values()]
    count = math.prod(len(o) for o in options)
    if count > _BRUTE_FORCE_MAX_CHOICES:
        raise SolverError(f"Brute force would try {count} choices (more than "
                          f"{_BRUTE_FORCE_MAX_CHOICES}); use ilp_tp for this size.")
    cap = problem.memory_capacity_bytes
    best: TPPlan | None = None
    for combo in itertools.product(*options):
        splits = {n: k for members, k in zip(groups.values(), combo) for n in members}
        plan = evaluate_tp(problem, splits, f"brute force over {count} choices")
        if cap is not None and plan.memory_bytes > cap:
            continue
        if best is None or plan.time_s < best.time_s:
            best = plan
    if best is None:
        raise InfeasiblePlanError(_explain_infeasible(problem))
    return best


def _explain_infeasible(problem: TPProblem) -> str:
    cap = problem.memory_capacity_bytes
    if cap is None:
        raise SolverError("The tensor-parallel problem has no memory limit, yet no choice "
                          "was found; the solver answer is wrong.")
    least = {l.name: min(l.options, key=lambda o: o.memory_bytes) for l in problem.layers}
    total = sum(o.memory_bytes for o in least.values())
    if total <= cap * (1 - _MEMORY_SLACK):
        raise SolverError(f"HiGHS reported no feasible splits, but the smallest split of every "
                          f"layer fits ({total:.0f} of {cap:.0f} bytes); the solver is wrong.")
    binding = max(least, key=lambda n: least[n].memory_bytes)
    return (f"Memory binds at tensor-parallel degree {problem.degree}: even the smallest split "
            f"of every layer needs {size_text(total)} per device and a device holds "
            f"{size_text(cap)}; "
            f"the largest is layer {binding!r} ({least[binding].split}: "
            f"{size_text(least[binding].memory_bytes)}). Use a larger tensor-parallel degree, "
            "pipeline stages, or devices with more memory.")
