"""Splitting a layer order into pipeline stages: the ILP, brute force, and the re-check.

Pipeline position: ``planner.search`` prices each layer (time per micro-batch,
memory) with the cost model, hands a ``SplitProblem`` to ``best_split`` and gets
back a ``Split``. Three solvers answer the same problem: ``ilp_split`` (scipy.
optimize.milp / HiGHS; the formulation later issues extend), ``dp_split``
(dynamic programming, exact for today's separable costs; it gives the ILP an
upper bound and stands in for it on large problems) and ``brute_force_split``
(enumeration, for tests). Every answer goes through ``check_split`` before
anyone sees it (scipy issue 24141: milp can report success for a solution that
breaks the constraints).

The problem: put layers 0..L-1 (a topological order) into S contiguous,
non-empty stages; each stage's memory must fit; minimise the slowest stage's
time per micro-batch (its layers' forward+backward time plus the tensors it
sends to the next stage). A tensor that skips stages is relayed: it crosses
every boundary between its producer and its last reader, is paid for at each,
and is held by every stage it enters. A tensor read by several later layers
crosses a boundary once.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from tfplan.core.errors import InfeasiblePlanError, SolverError
from tfplan.planner.milp import HIGHS, Milp, NoSolutionInTime, lin, pick_one, size_text

# Relative slack on the memory rows of the ILP, so that HiGHS's feasibility
# tolerance (1e-7 on the scaled rows) cannot hand back a split that overflows
# memory by a rounding error.
_MEMORY_SLACK = 1e-6
# The ILP measures time in units of (total work / _TIME_SCALE), so HiGHS's
# absolute tolerances (1e-6) are negligible relative to any stage time.
_TIME_SCALE = 1000.0
_BRUTE_FORCE_MAX_SPLITS = 200_000
# Above this many x[i, s] binaries ``best_split`` keeps the DP's split: the contiguity
# rows grow as L S^2, and 128 layers x 16 stages already takes HiGHS ~3 s (32 stages:
# ~18 s), where the DP takes milliseconds and is exact for this cost model.
ILP_MAX_BINARIES = 1024


@dataclass(frozen=True)
class Transfer:
    """One layer's output tensor, read by layers later in the order."""

    src: int  # index of the producing layer
    dsts: tuple[int, ...]  # indices of the reading layers (all > src)
    send_time_s: tuple[float, ...]  # per boundary s (stage s -> s+1), per micro-batch
    recv_memory_bytes: float  # what a stage it enters holds (margin included)


@dataclass(frozen=True)
class SplitProblem:
    """Everything a splitter needs; built by ``planner.search`` from the cost model."""

    layer_names: tuple[str, ...]
    layer_time_s: tuple[float, ...]  # forward + backward, per micro-batch
    layer_memory_bytes: tuple[float, ...]  # margin included
    transfers: tuple[Transfer, ...]
    num_stages: int
    memory_capacity_bytes: float | None = None  # None: no memory limit

    def __post_init__(self) -> None:
        n = len(self.layer_names)
        if len(self.layer_time_s) != n or len(self.layer_memory_bytes) != n:
            raise SolverError(
                f"SplitProblem: {n} layer names but {len(self.layer_time_s)} times and "
                f"{len(self.layer_memory_bytes)} memories; expected one of each per layer.")
        if self.num_stages < 1:
            raise SolverError(f"SplitProblem: num_stages is {self.num_stages}; expected >= 1.")
        if self.num_stages > n:
            raise InfeasiblePlanError(
                f"Cannot split {n} layers into {self.num_stages} non-empty pipeline stages; "
                f"use at most {n} stages.")
        for k, t in enumerate(self.transfers):
            if not t.dsts or not 0 <= t.src < min(t.dsts) or max(t.dsts) >= n:
                raise SolverError(
                    f"SplitProblem: transfer {k} goes from layer {t.src} to {t.dsts}; expected "
                    f"readers after the producer, within 0..{n - 1} (a topological order).")
            if len(t.send_time_s) != self.num_stages - 1:
                raise SolverError(
                    f"SplitProblem: transfer {k} has {len(t.send_time_s)} send times; expected "
                    f"one per boundary ({self.num_stages - 1}).")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


@dataclass(frozen=True)
class StageCost:
    start: int  # first layer index
    stop: int  # one past the last layer index
    compute_s: float  # per micro-batch, forward + backward
    send_s: float  # per micro-batch, tensors sent to the next stage
    memory_bytes: int

    @property
    def time_s(self) -> float:
        return self.compute_s + self.send_s


@dataclass(frozen=True)
class Split:
    stage_of_layer: tuple[int, ...]
    stages: tuple[StageCost, ...]
    solver: str

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def slowest_stage(self) -> StageCost:
        return max(self.stages, key=lambda s: s.time_s)


# --- evaluating a split ----------------------------------------------------------------

def _last_reader(t: Transfer, stage_of: Sequence[int]) -> int:
    return max(stage_of[d] for d in t.dsts)


def evaluate_split(problem: SplitProblem, stage_of_layer: Sequence[int]) -> tuple[StageCost, ...]:
    """Per-stage time and memory of a contiguous split (``check_split`` checks it first)."""
    s_count = problem.num_stages
    compute = [0.0] * s_count
    send = [0.0] * s_count
    memory = [0.0] * s_count
    for i, s in enumerate(stage_of_layer):
        compute[s] += problem.layer_time_s[i]
        memory[s] += problem.layer_memory_bytes[i]
    for t in problem.transfers:
        first, last = stage_of_layer[t.src], _last_reader(t, stage_of_layer)
        for boundary in range(first, last):  # crosses stage b -> b+1
            send[boundary] += t.send_time_s[boundary]
            memory[boundary + 1] += t.recv_memory_bytes
    bounds = [[None, None] for _ in range(s_count)]
    for i, s in enumerate(stage_of_layer):
        bounds[s][0] = i if bounds[s][0] is None else bounds[s][0]
        bounds[s][1] = i + 1
    return tuple(StageCost(start=b[0], stop=b[1], compute_s=compute[s], send_s=send[s],
                           memory_bytes=math.ceil(memory[s]))
                 for s, b in enumerate(bounds))


def check_split(problem: SplitProblem, stage_of_layer: Sequence[int],
                solver: str = "the solver") -> tuple[StageCost, ...]:
    """Re-check a split against every constraint; SolverError names the first broken one."""
    n, s_count = problem.num_layers, problem.num_stages
    stage_of = list(stage_of_layer)
    if len(stage_of) != n:
        raise SolverError(f"{solver} placed {len(stage_of)} layers; the model has {n}.")
    bad = [i for i, s in enumerate(stage_of) if not (isinstance(s, int) and 0 <= s < s_count)]
    if bad:
        raise SolverError(f"{solver} put layer {problem.layer_names[bad[0]]!r} in stage "
                          f"{stage_of[bad[0]]!r}; expected a stage in 0..{s_count - 1}.")
    if stage_of[0] != 0 or stage_of[-1] != s_count - 1:
        raise SolverError(f"{solver} starts at stage {stage_of[0]} and ends at stage "
                          f"{stage_of[-1]}; expected 0 and {s_count - 1} (every stage used).")
    for i in range(n - 1):
        step = stage_of[i + 1] - stage_of[i]
        if step not in (0, 1):
            raise SolverError(
                f"{solver} put layer {problem.layer_names[i]!r} in stage {stage_of[i]} and the "
                f"next layer {problem.layer_names[i + 1]!r} in stage {stage_of[i + 1]}; stages "
                "must be contiguous and non-empty.")
    stages = evaluate_split(problem, stage_of)
    cap = problem.memory_capacity_bytes
    for s, cost in enumerate(stages):
        if cap is not None and cost.memory_bytes > cap:
            raise SolverError(
                f"{solver} returned stage {s} ({_span(problem, cost)}) needing "
                f"{cost.memory_bytes} bytes, over the {int(cap)}-byte capacity.")
    return stages


def _span(problem: SplitProblem, cost: StageCost) -> str:
    first, last = problem.layer_names[cost.start], problem.layer_names[cost.stop - 1]
    return f"layer {first}" if cost.start == cost.stop - 1 else f"layers {first}..{last}"


# --- the ILP -------------------------------------------------------------------------------

def ilp_split(problem: SplitProblem, *, time_limit_s: float = 10.0,
              upper_bound_s: float | None = None) -> Split:
    """The best split by ILP (scipy.optimize.milp / HiGHS), re-checked before it returns.

    Variables
      x[i, s]  binary      layer i is in stage s
      y[k, s]  in [0, 1]   transfer k crosses boundary s (stage s -> s+1)
      T        >= 0        time of the slowest stage per micro-batch
    Expressions
      stage(i) = sum_s s x[i, s]
      z[i, s]  = sum_{t <= s} x[i, t]          (layer i is in stage s or earlier)
      transfer k from u to reader d crosses boundary s  <=>  z[u, s] - z[d, s] = 1
    Objective
      min T + eps * sum_i stage(i)              (eps breaks ties: earliest stages)

    ``upper_bound_s``: the slowest-stage time of a known split (``dp_split``), an
    upper bound on T. It does not change the optimum, and HiGHS, spared the hunt
    for a good first solution, solves 100 layers x 8 stages in 0.2 s, not 6 s.
    """
    n, s_count = problem.num_layers, problem.num_stages
    layers, stages, bounds = range(n), range(s_count), range(s_count - 1)
    transfers = range(len(problem.transfers))
    total = sum(problem.layer_time_s) + sum(max(t.send_time_s, default=0.0)
                                            for t in problem.transfers)
    unit_s = total / _TIME_SCALE if total > 0 else 1.0
    # A stage fits when ceil(its bytes) <= capacity, i.e. its bytes <= floor(capacity).
    cap = None if problem.memory_capacity_bytes is None \
        else math.floor(problem.memory_capacity_bytes)
    norm = max(cap or 1, 1)  # memory rows are divided by the capacity (scaled to ~1)

    m = Milp()
    x = m.family(itertools.product(layers, stages), lower=0, upper=1, integer=True)
    y = m.family(itertools.product(transfers, bounds), lower=0, upper=1, integer=False)
    t_max = math.inf if upper_bound_s is None else upper_bound_s / unit_s * (1 + 1e-6) + 1e-9
    big_t = m.family(["T"], lower=0, upper=t_max, integer=False)["T"]

    def stage(i: int) -> list[tuple[int, float]]:
        return [(x[i, s], float(s)) for s in stages]

    def z(i: int, s: int) -> list[tuple[int, float]]:
        return [(x[i, t], 1.0) for t in range(s + 1)]

    def neg(terms: list[tuple[int, float]]) -> list[tuple[int, float]]:
        return [(var, -coef) for var, coef in terms]

    eps = 1e-3 / (n * (s_count - 1) + 1)
    m.minimise(lin([(big_t, 1.0)], *([(var, eps * c) for var, c in stage(i)] for i in layers)))

    # assign[i]: each layer in exactly one stage.
    for i in layers:
        m.constrain(f"assign[{i}]", lin([(x[i, s], 1.0) for s in stages]), 1, 1)
    # order[i]: contiguity, 0 <= stage(i+1) - stage(i) <= 1; ends pin every stage non-empty.
    for i in range(n - 1):
        m.constrain(f"order[{i}]", lin(stage(i + 1), neg(stage(i))), 0, 1)
    m.constrain("first", lin(stage(0)), 0, 0)
    m.constrain("last", lin(stage(n - 1)), s_count - 1, s_count - 1)
    # monotone[i, s], step[i, s]: the same contiguity per stage (z[i+1, s] <= z[i, s] and
    # z[i, s] <= z[i+1, s+1]). Implied by order[i] for 0/1 values; they tighten the LP
    # relaxation, which cuts HiGHS's search several-fold.
    for i in range(n - 1):
        for s in bounds:
            m.constrain(f"monotone[{i},{s}]", lin(z(i, s), neg(z(i + 1, s))), lo=0)
            m.constrain(f"step[{i},{s}]", lin(z(i + 1, s + 1), neg(z(i, s))), lo=0)
    # crosses[k, d, s]: y[k, s] >= z[src, s] - z[d, s] for every reader d.
    for k, t in enumerate(problem.transfers):
        for d in sorted(set(t.dsts)):
            for s in bounds:
                m.constrain(f"crosses[{k},{d},{s}]",
                            lin([(y[k, s], 1.0)], neg(z(t.src, s)), z(d, s)), lo=0)
    # memory[s]: layers held + tensors received across boundary s-1 <= capacity.
    if cap is not None:
        for s in stages:
            received = [(y[k, s - 1], t.recv_memory_bytes / norm)
                        for k, t in enumerate(problem.transfers)] if s > 0 else []
            m.constrain(f"memory[{s}]", lin(
                [(x[i, s], problem.layer_memory_bytes[i] / norm) for i in layers], received),
                hi=cap / norm * (1.0 - _MEMORY_SLACK))
    # time[s]: T >= compute of stage s + tensors it sends across boundary s.
    for s in stages:
        sent = [(y[k, s], t.send_time_s[s] / unit_s)
                for k, t in enumerate(problem.transfers)] if s < s_count - 1 else []
        m.constrain(f"time[{s}]", lin(
            [(x[i, s], problem.layer_time_s[i] / unit_s) for i in layers], sent,
            [(big_t, -1.0)]), hi=0.0)

    name = f"ILP ({HIGHS})"
    res = m.solve_or_raise(
        time_limit_s, name=name, what=f"split of {n} layers into {s_count} stages",
        infeasible=lambda: _explain_infeasible(problem, solver_said_infeasible=True),
        advice=" or use fewer stages")
    status = ("optimal" if res.status == 0 else
              f"time limit {time_limit_s:g} s reached, best split found "
              f"(gap {100 * (res.mip_gap or 0):.2g}%)")
    stage_of = [pick_one(res.x, {s: x[i, s] for s in stages},
                         f"{name} returned a fractional placement for layer "
                         f"{problem.layer_names[i]!r}") for i in layers]
    solver = f"{name}: {status}, {s_count} stages"
    costs = check_split(problem, stage_of, name)
    bottleneck = max(c.time_s for c in costs)
    if bottleneck > res.x[big_t] * unit_s * (1 + 1e-6) + 1e-12:
        raise SolverError(f"{name} reported a slowest stage of {res.x[big_t] * unit_s:.6g} s "
                          f"but its split has a stage taking {bottleneck:.6g} s.")
    return Split(stage_of_layer=tuple(stage_of), stages=costs, solver=solver)


# --- brute force (tiny inputs, tests) --------------------------------------------------------

def brute_force_split(problem: SplitProblem) -> Split:
    """The best split by enumerating every composition of L layers into S stages.

    Same objective and tie-break as ``ilp_split`` (slowest stage, then the
    smallest sum of stage indices). For tests and tiny models only.
    """
    n, s_count = problem.num_layers, problem.num_stages
    count = math.comb(n - 1, s_count - 1)
    if count > _BRUTE_FORCE_MAX_SPLITS:
        raise SolverError(f"Brute force would try {count} splits (more than "
                          f"{_BRUTE_FORCE_MAX_SPLITS}); use ilp_split for this size.")
    cap = problem.memory_capacity_bytes
    best: tuple[float, int] | None = None
    best_split: tuple[tuple[int, ...], tuple[StageCost, ...]] | None = None
    for cuts in itertools.combinations(range(1, n), s_count - 1):
        edges = (0, *cuts, n)
        stage_of = tuple(s for s in range(s_count) for _ in range(edges[s], edges[s + 1]))
        costs = evaluate_split(problem, stage_of)
        if cap is not None and any(c.memory_bytes > cap for c in costs):
            continue
        key = (max(c.time_s for c in costs), sum(stage_of))
        if best is None or key < best:
            best, best_split = key, (stage_of, costs)
    if best_split is None:
        raise InfeasiblePlanError(_explain_infeasible(problem))
    return Split(stage_of_layer=best_split[0], stages=best_split[1],
                 solver=f"brute force over {count} splits")


# --- dynamic programming (exact for this cost; seeds the ILP) -------------------------------------

def dp_split(problem: SplitProblem) -> Split:
    """The best split by dynamic programming over contiguous splits, O(S L^2).

    Exact for this problem because a stage's time and memory depend only on its
    first and last layer and its index: best[k][j] = min over a of
    max(best[k-1][a], time(a, j, stage k-1)) among stages a..j-1 that fit. Ties in
    the slowest stage are broken by the earliest cut, which need not be the ILP's
    tie-break; the bottleneck is the same.
    """
    import numpy as np

    t = _prefix_tables(problem)
    cap, last = problem.memory_capacity_bytes, problem.num_stages - 1

    def stage_time_s(k: int, starts, j: int):
        time_s = t["time"][j] - t["time"][starts] + (t["sent"][j, k] if k < last else 0.0)
        if cap is None:
            return time_s
        memory = t["memory"][j] - t["memory"][starts] + t["received"][starts]
        return np.where(np.ceil(memory) <= cap, time_s, np.inf)

    spans = _min_max_spans(problem, stage_time_s)
    if spans is None:
        raise InfeasiblePlanError(_explain_infeasible(problem))
    stage_of = tuple(s for s, (a, b) in enumerate(spans) for _ in range(a, b))
    costs = check_split(problem, stage_of, "dynamic programming")
    return Split(stage_of_layer=stage_of, stages=costs, solver="dynamic programming")


def _prefix_tables(problem: SplitProblem) -> dict:
    """Prefix sums that price a stage a..b-1 in O(1): time, memory, the tensors it
    receives (by its first layer a) and sends (by its end b, per boundary)."""
    import numpy as np

    n, s_count = problem.num_layers, problem.num_stages
    received = np.zeros(n + 1)
    sent = np.zeros((n + 1, max(s_count - 1, 1)))
    for t in problem.transfers:
        received[t.src + 1:max(t.dsts) + 1] += t.recv_memory_bytes
        sent[t.src + 1:max(t.dsts) + 1, :s_count - 1] += np.array(t.send_time_s)
    return {"time": np.concatenate(([0.0], np.cumsum(problem.layer_time_s))),
            "memory": np.concatenate(([0.0], np.cumsum(problem.layer_memory_bytes))),
            "received": received, "sent": sent}


def _min_max_spans(problem: SplitProblem, stage_value) -> list[tuple[int, int]] | None:
    """The S contiguous spans minimising the largest ``stage_value(k, starts, j)`` (the
    value of stage k holding layers a..j-1, for a vector of starts a; inf: not allowed);
    None when every split has a stage that is not allowed."""
    import numpy as np

    n, s_count = problem.num_layers, problem.num_stages
    best = np.full((s_count + 1, n + 1), np.inf)
    choice = np.zeros((s_count + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, s_count + 1):
        for j in range(k, n - (s_count - k) + 1):
            starts = np.arange(k - 1, j)
            cand = np.maximum(best[k - 1, starts], stage_value(k - 1, starts, j))
            pick = int(np.argmin(cand))
            best[k, j], choice[k, j] = cand[pick], starts[pick]
    if not np.isfinite(best[s_count, n]):
        return None
    spans, j = [], n
    for k in range(s_count, 0, -1):
        spans.append((int(choice[k, j]), j))
        j = int(choice[k, j])
    return spans[::-1]


def best_split(problem: SplitProblem, *, time_limit_s: float = 10.0,
               max_ilp_binaries: int | None = None) -> Split:
    """The split ``planner.search`` uses: ``dp_split`` bounds the slowest stage, then
    ``ilp_split`` finds (and proves) the optimum under that bound. The DP's split is
    returned instead, and its solver string says why, when the ILP would have more
    than ``max_ilp_binaries`` (default ILP_MAX_BINARIES) x variables, when HiGHS runs
    out of time without a split, or when it finds none inside its memory safety margin."""
    seed = dp_split(problem)
    limit = ILP_MAX_BINARIES if max_ilp_binaries is None else max_ilp_binaries
    binaries = problem.num_layers * problem.num_stages
    if binaries > limit:
        return Split(stage_of_layer=seed.stage_of_layer, stages=seed.stages,
                     solver=f"dynamic programming (exact for this cost model; the ILP is "
                            f"skipped above {limit} binaries, this split has {binaries})")
    try:
        return ilp_split(problem, time_limit_s=time_limit_s, upper_bound_s=seed.bottleneck_s)
    except NoSolutionInTime as e:
        note = str(e)
    except InfeasiblePlanError:  # only a stage within _MEMORY_SLACK of the capacity fits
        note = "the ILP's memory rows keep a 1e-6 safety margin that this split needs"
    return Split(stage_of_layer=seed.stage_of_layer, stages=seed.stages,
                 solver=f"dynamic programming ({note})")


# --- diagnosing memory ---------------------------------------------------------------------------

def min_max_stage_memory(problem: SplitProblem) -> tuple[float, tuple[int, int]]:
    """The smallest possible memory of the fullest stage over all S-stage splits, and
    that stage's (start, stop). Dynamic programming over contiguous splits."""
    t = _prefix_tables(problem)

    def memory(k: int, starts, j: int):
        return t["memory"][j] - t["memory"][starts] + t["received"][starts]

    spans = _min_max_spans(problem, memory)
    fullest = max(spans, key=lambda span: memory(0, span[0], span[1]))
    return float(memory(0, fullest[0], fullest[1])), fullest


def min_stages_to_fit(problem: SplitProblem) -> int | None:
    """Fewest contiguous stages whose memory all fits (None if one layer alone cannot)."""
    cap = problem.memory_capacity_bytes
    n = problem.num_layers
    if cap is None:
        return 1
    import numpy as np

    t = _prefix_tables(problem)
    fewest = np.full(n + 1, np.inf)
    fewest[0] = 0
    for b in range(1, n + 1):
        starts = np.arange(b)
        memory = t["memory"][b] - t["memory"][starts] + t["received"][starts]
        fits = np.ceil(memory) <= cap
        if fits.any():
            fewest[b] = fewest[starts[fits]].min() + 1
    return None if not np.isfinite(fewest[n]) else int(fewest[n])


def _explain_infeasible(problem: SplitProblem, solver_said_infeasible: bool = False) -> str:
    cap = problem.memory_capacity_bytes
    if cap is None:
        raise SolverError("The split problem has no memory limit, yet no split was found.")
    worst = max(range(problem.num_layers), key=lambda i: problem.layer_memory_bytes[i])
    fullest, (a, b) = min_max_stage_memory(problem)
    if solver_said_infeasible and fullest <= math.floor(cap) * (1 - _MEMORY_SLACK):
        raise SolverError(
            f"HiGHS reported no feasible {problem.num_stages}-stage split, but layers "
            f"{problem.layer_names[a]}..{problem.layer_names[b - 1]} as the fullest stage fit "
            f"({fullest:.0f} of {cap:.0f} bytes); the solver answer is wrong.")
    layer_bytes = problem.layer_memory_bytes[worst]
    if layer_bytes > cap:
        return (f"Memory binds: layer {problem.layer_names[worst]!r} alone needs "
                f"{size_text(layer_bytes)} and a device holds {size_text(cap)}; no pipeline split "
                "can help. Use devices with more memory or a smaller batch.")
    fewest = min_stages_to_fit(problem)
    need = (f"; at least {fewest} stages would fit" if fewest is not None else "")
    return (f"Memory binds: the best split of {problem.num_layers} layers into "
            f"{problem.num_stages} stages still needs {size_text(fullest)} on its fullest stage "
            f"(layers {problem.layer_names[a]}..{problem.layer_names[b - 1]}) and a device "
            f"holds {size_text(cap)}{need}.")

