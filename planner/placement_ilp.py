"""General device placement for a few devices and a branchy graph: the MILP, brute force, re-check.

Pipeline position: for a small branchy model on a few identical devices,
``planner.placement_search`` (a candidate of ``planner.search``) prices each layer
(forward + backward time, memory) and each edge (transfer time when its ends sit on
different devices), hands a ``PlacementProblem`` to ``ilp_placement`` and gets back a
``Placement``: a device per layer and a schedule. Unlike pipeline stages, layers need
not be contiguous and independent branches run at the same time on different devices.
``brute_force_placement`` answers the same problem for tiny graphs (tests). Every answer
goes through ``check_placement`` before anyone sees it (scipy issue 24141).

The formulation is the classic disjunctive scheduling MILP (Manne, "On the job-shop
scheduling problem", Operations Research 1960, big-M order binaries), with placement
binaries as in task-graph scheduling on identical processors. Its size grows with
the square of the layers and its search exponentially, so it is kept to
``MAX_LAYERS`` layers and ``MAX_DEVICES`` devices; beyond that use the pipeline
ILP (``planner.pipeline_ilp``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import networkx as nx

from tfplan.core.errors import InfeasiblePlanError, SolverError
from tfplan.planner.milp import HIGHS, Milp, lin, pick_one, size_text

MAX_LAYERS = 12
MAX_DEVICES = 4
_MEMORY_SLACK = 1e-6
_TIME_SCALE = 1000.0
_CHECK_TOL = 1e-9  # relative to the horizon, on re-checked times
_SOLVER_TOL = 1e-6  # on HiGHS's own times (its feasibility tolerance, scaled)
_BRUTE_FORCE_MAX_PLACEMENTS = 20_000


@dataclass(frozen=True)
class PlacementEdge:
    src: str
    dst: str
    transfer_time_s: float  # forward tensor + its gradient, when src and dst differ


@dataclass(frozen=True)
class PlacementProblem:
    layer_names: tuple[str, ...]  # a topological order
    layer_time_s: tuple[float, ...]  # forward + backward, on any one device
    layer_memory_bytes: tuple[float, ...]
    edges: tuple[PlacementEdge, ...]
    num_devices: int  # identical devices, any pair joined by the same link
    memory_capacity_bytes: float | None = None

    def __post_init__(self) -> None:
        n = len(self.layer_names)
        if len(self.layer_time_s) != n or len(self.layer_memory_bytes) != n:
            raise SolverError(f"PlacementProblem: {n} layer names but {len(self.layer_time_s)} "
                              f"times and {len(self.layer_memory_bytes)} memories.")
        if len(set(self.layer_names)) != n:
            raise SolverError("PlacementProblem: layer names must be unique.")
        if self.num_devices < 1:
            raise SolverError(f"PlacementProblem: num_devices is {self.num_devices}; "
                              "expected >= 1.")
        if any(t < 0 for t in self.layer_time_s) or any(e.transfer_time_s < 0
                                                         for e in self.edges):
            raise SolverError("PlacementProblem: times must be >= 0.")
        position = {name: i for i, name in enumerate(self.layer_names)}
        for e in self.edges:
            if e.src not in position or e.dst not in position or \
                    position[e.src] >= position[e.dst]:
                raise SolverError(f"PlacementProblem: edge {e.src!r} -> {e.dst!r} must join "
                                  "two layers, producer first (a topological order).")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(range(self.num_layers))
        index = {name: i for i, name in enumerate(self.layer_names)}
        for e in self.edges:
            g.add_edge(index[e.src], index[e.dst])
        return g


@dataclass(frozen=True)
class Placement:
    device_of_layer: tuple[int, ...]
    start_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    memory_bytes_per_device: tuple[float, ...]
    solver: str

    @property
    def makespan_s(self) -> float:
        return max(self.finish_s, default=0.0)


# --- scheduling a fixed placement, and the re-check -----------------------------------------------

def _edge_times(problem: PlacementProblem) -> dict[tuple[int, int], float]:
    index = {name: i for i, name in enumerate(problem.layer_names)}
    times: dict[tuple[int, int], float] = {}
    for e in problem.edges:  # several tensors between one pair: their transfers add up
        key = (index[e.src], index[e.dst])
        times[key] = times.get(key, 0.0) + e.transfer_time_s
    return times


def schedule(problem: PlacementProblem, device_of_layer, order_on_device) -> tuple | None:
    """Earliest start times for a placement and an order of layers on each device
    (longest paths over precedence + device-order arcs); None if they form a cycle."""
    edges = _edge_times(problem)
    g = problem.graph()
    for seq in order_on_device:
        g.add_edges_from(zip(seq, seq[1:]))
    if not nx.is_directed_acyclic_graph(g):
        return None
    start = [0.0] * problem.num_layers
    for v in nx.topological_sort(g):
        for u in g.predecessors(v):
            delay = edges.get((u, v), 0.0) if device_of_layer[u] != device_of_layer[v] else 0.0
            start[v] = max(start[v], start[u] + problem.layer_time_s[u] + delay)
    return tuple(start)


def check_placement(problem: PlacementProblem, device_of_layer, start_s,
                    solver: str = "the solver", tol_rel: float = _CHECK_TOL) -> Placement:
    """Re-check a placement and schedule: devices in range, precedence with transfers,
    no two layers overlapping on one device, memory; SolverError names the first break."""
    n, d_count = problem.num_layers, problem.num_devices
    dev, start = list(device_of_layer), [float(s) for s in start_s]
    if len(dev) != n or len(start) != n:
        raise SolverError(f"{solver} placed {len(dev)} layers and timed {len(start)}; "
                          f"the problem has {n}.")
    names, t = problem.layer_names, problem.layer_time_s
    tol = tol_rel * (sum(t) + sum(e.transfer_time_s for e in problem.edges) + 1e-300)
    for v in range(n):
        if not (isinstance(dev[v], int) and 0 <= dev[v] < d_count):
            raise SolverError(f"{solver} put layer {names[v]!r} on device {dev[v]!r}; expected "
                              f"0..{d_count - 1}.")
        if start[v] < -tol:
            raise SolverError(f"{solver} starts layer {names[v]!r} at {start[v]:.6g} s < 0.")
    finish = [start[v] + t[v] for v in range(n)]
    for (u, v), delay in _edge_times(problem).items():
        ready = finish[u] + (delay if dev[u] != dev[v] else 0.0)
        if start[v] < ready - tol:
            raise SolverError(f"{solver} starts layer {names[v]!r} at {start[v]:.6g} s, before "
                              f"its input from {names[u]!r} arrives at {ready:.6g} s.")
    for u, v in itertools.combinations(range(n), 2):
        if dev[u] == dev[v] and t[u] > 0 and t[v] > 0 and \
                min(finish[u], finish[v]) - max(start[u], start[v]) > tol:
            raise SolverError(f"{solver} runs layers {names[u]!r} and {names[v]!r} at the same "
                              f"time on device {dev[u]}.")
    memory = [0.0] * d_count
    for v in range(n):
        memory[dev[v]] += problem.layer_memory_bytes[v]
    cap = problem.memory_capacity_bytes
    for d, used in enumerate(memory):
        if cap is not None and used > cap:
            raise SolverError(f"{solver} puts {used:.0f} bytes on device {d}, over the "
                              f"{cap:.0f}-byte capacity.")
    return Placement(device_of_layer=tuple(dev), start_s=tuple(start), finish_s=tuple(finish),
                     memory_bytes_per_device=tuple(memory), solver=solver)


def _check_size(problem: PlacementProblem) -> None:
    if problem.num_layers > MAX_LAYERS or problem.num_devices > MAX_DEVICES:
        raise SolverError(
            f"General placement is for small graphs: received {problem.num_layers} layers on "
            f"{problem.num_devices} devices, the limit is {MAX_LAYERS} layers and {MAX_DEVICES} "
            "devices (the MILP's search grows exponentially). Use pipeline stages "
            "(planner.pipeline_ilp.best_split) for larger models.")


# --- the MILP ------------------------------------------------------------------------------------

def ilp_placement(problem: PlacementProblem, *, time_limit_s: float = 10.0) -> Placement:
    """The placement and schedule with the smallest makespan, by MILP, re-checked.

    Variables
      x[v, d]  binary      layer v runs on device d
      S[v]     in [0, H]   start time (H: every layer and transfer in series)
      y[u, v]  in [0, 1]   edge u -> v crosses devices (>= x[u, d] - x[v, d])
      z[u, v]  in [0, 1]   u and v share a device (>= x[u, d] + x[v, d] - 1), unordered pairs
      o[u, v]  binary      u before v, for pairs that no path orders
      C        >= 0        makespan
    Constraints
      assign[v]          sum_d x[v, d] = 1
      first_use[v, d]    x[v, d] = 0 for d > v (devices are identical: symmetry breaking)
      cross[u, v, d]     y[u, v] >= x[u, d] - x[v, d]
      precede[u, v]      S[u] + t_u + c_uv y[u, v] <= S[v]
      same[u, v, d]      z[u, v] >= x[u, d] + x[v, d] - 1
      before[u, v]       S[u] + t_u <= S[v] + H (1 - o[u, v]) + H (1 - z[u, v])
      after[u, v]        S[v] + t_v <= S[u] + H o[u, v] + H (1 - z[u, v])
      memory[d]          sum_v mem_v x[v, d] <= capacity (only if all layers exceed it)
      makespan[v]        S[v] + t_v + tail_v <= C
    Valid inequalities (true of every schedule; they tighten the big-M relaxation, which
    alone leaves C near 0 and the search to branching)
      head[v]            S[v] >= head_v
      load[d]            sum_v t_v x[v, d] <= C   (a device runs its layers one at a time)
    with head_v / tail_v the longest chain of layer times before / after v (no transfers).
    Objective: min C.
    """
    _check_size(problem)
    n, d_count = problem.num_layers, problem.num_devices
    layers, devices = range(n), range(d_count)
    t = problem.layer_time_s
    edges = _edge_times(problem)
    closure = nx.transitive_closure_dag(problem.graph())
    free_pairs = [(u, v) for u, v in itertools.combinations(layers, 2)
                  if not closure.has_edge(u, v) and not closure.has_edge(v, u)]
    horizon_s = sum(t) + sum(edges.values())
    unit_s = horizon_s / _TIME_SCALE if horizon_s > 0 else 1.0
    big_h = horizon_s / unit_s if horizon_s > 0 else 1.0

    m = Milp()
    x = m.family(itertools.product(layers, devices), lower=0, upper=1, integer=True)
    start = m.family(layers, lower=0, upper=big_h, integer=False)
    y = m.family(edges, lower=0, upper=1, integer=False)
    z = m.family(free_pairs, lower=0, upper=1, integer=False)
    o = m.family(free_pairs, lower=0, upper=1, integer=True)
    c_max = m.family(["C"], lower=0, upper=big_h, integer=False)["C"]
    m.minimise({c_max: 1.0})
    head_s, tail_s = _chain_bounds(problem)

    for v in layers:
        m.constrain(f"assign[{v}]", lin([(x[v, d], 1.0) for d in devices]), 1, 1)
        for d in devices:
            if d > v:
                m.constrain(f"first_use[{v},{d}]", {x[v, d]: 1.0}, 0, 0)
        m.constrain(f"makespan[{v}]", lin([(start[v], 1.0), (c_max, -1.0)]),
                    hi=-(t[v] + tail_s[v]) / unit_s)
        if head_s[v] > 0:
            m.constrain(f"head[{v}]", {start[v]: 1.0}, lo=head_s[v] / unit_s)
    for d in devices:
        m.constrain(f"load[{d}]", lin([(x[v, d], t[v] / unit_s) for v in layers],
                                       [(c_max, -1.0)]), hi=0)
    for (u, v), c in edges.items():
        for d in devices:
            m.constrain(f"cross[{u},{v},{d}]", lin(
                [(y[u, v], 1.0), (x[u, d], -1.0), (x[v, d], 1.0)]), lo=0)
        m.constrain(f"precede[{u},{v}]", lin(
            [(start[u], 1.0), (y[u, v], c / unit_s), (start[v], -1.0)]), hi=-t[u] / unit_s)
    for u, v in free_pairs:
        for d in devices:
            m.constrain(f"same[{u},{v},{d}]", lin(
                [(z[u, v], 1.0), (x[u, d], -1.0), (x[v, d], -1.0)]), lo=-1)
        # S[u] - S[v] + H o + H z <= 2H - t_u ;  S[v] - S[u] - H o + H z <= H - t_v
        m.constrain(f"before[{u},{v}]", lin(
            [(start[u], 1.0), (start[v], -1.0), (o[u, v], big_h), (z[u, v], big_h)]),
            hi=2 * big_h - t[u] / unit_s)
        m.constrain(f"after[{u},{v}]", lin(
            [(start[v], 1.0), (start[u], -1.0), (o[u, v], -big_h), (z[u, v], big_h)]),
            hi=big_h - t[v] / unit_s)
    cap = problem.memory_capacity_bytes
    if cap is not None and sum(problem.layer_memory_bytes) > cap * (1 - _MEMORY_SLACK):
        # (rows that cannot bind are left out: tiny coefficients made HiGHS fail to solve)
        norm = max(cap, 1.0)
        for d in devices:
            m.constrain(f"memory[{d}]", lin(
                [(x[v, d], problem.layer_memory_bytes[v] / norm) for v in layers]),
                hi=cap / norm * (1 - _MEMORY_SLACK))

    name = f"MILP ({HIGHS})"
    res = m.solve_or_raise(time_limit_s, name=name,
                           what=f"placement of {n} layers on {d_count} devices",
                           infeasible=lambda: _explain_infeasible(problem))
    device_of = [pick_one(res.x, {d: x[v, d] for d in devices},
                          f"{name} returned a fractional placement for layer "
                          f"{problem.layer_names[v]!r}") for v in layers]
    status = "optimal" if res.status == 0 else "time limit reached, best found"
    solver = f"{name}: {status}, {d_count} devices"
    # The solver's own times, re-checked as they are; then the same orders left-shifted
    # to exact earliest starts (HiGHS's times carry its tolerances).
    raw = [float(res.x[start[v]]) * unit_s for v in layers]
    check_placement(problem, device_of, raw, solver, tol_rel=_SOLVER_TOL)
    orders = [sorted((v for v in layers if device_of[v] == d), key=lambda v: (raw[v], v))
              for d in devices]
    exact = schedule(problem, device_of, orders)
    if exact is None:
        raise SolverError(f"{name} returned device orders that contradict the layer graph.")
    placement = check_placement(problem, device_of, exact, solver)
    if placement.makespan_s > res.x[c_max] * unit_s * (1 + 1e-6) + 1e-12:
        raise SolverError(f"{name} reported a makespan of {res.x[c_max] * unit_s:.6g} s but "
                          f"its schedule takes {placement.makespan_s:.6g} s.")
    return placement


def _chain_bounds(problem: PlacementProblem) -> tuple[list[float], list[float]]:
    """Per layer, the longest chain of layer times that must run before it (head) and
    after it (tail), transfers left out: lower bounds on its start and on the makespan."""
    g, t = problem.graph(), problem.layer_time_s
    order = list(nx.topological_sort(g))
    head = [0.0] * problem.num_layers
    tail = [0.0] * problem.num_layers
    for v in order:
        head[v] = max((head[u] + t[u] for u in g.predecessors(v)), default=0.0)
    for v in reversed(order):
        tail[v] = max((tail[w] + t[w] for w in g.successors(v)), default=0.0)
    return head, tail


# --- brute force (tiny inputs, tests) --------------------------------------------------------

def _device_labellings(n: int, d_count: int):
    """Placements up to renaming identical devices (restricted growth strings)."""
    def grow(prefix: list[int], used: int):
        if len(prefix) == n:
            yield tuple(prefix)
            return
        for d in range(min(used + 1, d_count)):
            yield from grow(prefix + [d], max(used, d + 1))
    yield from grow([], 0)


def brute_force_placement(problem: PlacementProblem) -> Placement:
    """The best placement and schedule by enumeration: every placement (up to renaming
    devices) that fits, every order on each device consistent with the graph, earliest
    starts for each; an optimal schedule is the left-shifted one of some such order."""
    _check_size(problem)
    n, d_count = problem.num_layers, problem.num_devices
    closure = nx.transitive_closure_dag(problem.graph())
    cap = problem.memory_capacity_bytes
    best: tuple[float, tuple, tuple] | None = None
    tried = 0
    for device_of in _device_labellings(n, d_count):
        memory = [0.0] * d_count
        for v, d in enumerate(device_of):
            memory[d] += problem.layer_memory_bytes[v]
        if cap is not None and any(b > cap for b in memory):
            continue
        tried += 1
        if tried > _BRUTE_FORCE_MAX_PLACEMENTS:
            raise SolverError(f"Brute force would try more than {_BRUTE_FORCE_MAX_PLACEMENTS} "
                              "placements; use ilp_placement for this size.")
        per_device = []
        for d in range(d_count):
            members = [v for v in range(n) if device_of[v] == d]
            per_device.append([seq for seq in itertools.permutations(members)
                               if not any(closure.has_edge(b, a)
                                          for a, b in itertools.combinations(seq, 2))])
        for orders in itertools.product(*per_device):
            start = schedule(problem, device_of, orders)
            if start is None:
                continue
            makespan = max((start[v] + problem.layer_time_s[v] for v in range(n)), default=0.0)
            if best is None or makespan < best[0]:
                best = (makespan, device_of, start)
    if best is None:
        raise InfeasiblePlanError(_explain_infeasible(problem))
    return check_placement(problem, best[1], best[2],
                           f"brute force over {tried} placements")


def _explain_infeasible(problem: PlacementProblem) -> str:
    cap = problem.memory_capacity_bytes
    if cap is None:
        raise SolverError("The placement problem has no memory limit, yet no placement was "
                          "found; the solver answer is wrong.")
    names, mem = problem.layer_names, problem.layer_memory_bytes
    worst = max(range(problem.num_layers), key=lambda v: mem[v])
    if mem[worst] > cap:
        return (f"Memory binds: layer {names[worst]!r} alone needs {size_text(mem[worst])} and a "
                f"device holds {size_text(cap)}; no placement can help. Use devices with more "
                "memory or a smaller batch.")
    return (f"Memory binds: the {problem.num_layers} layers need {size_text(sum(mem))} in all and "
            f"no way of packing them onto {problem.num_devices} devices of {size_text(cap)} each "
            f"fits (the largest, {names[worst]!r}, needs {size_text(mem[worst])}). Use more "
            "devices or devices with more memory.")
