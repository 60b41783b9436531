"""General device placement as a search candidate: each layer on any device, branches at once.

Pipeline position: called by ``planner.search.search`` (unconstrained searches only)
with its ``SearchContext``; prices the model's layers and edges with the search's own cost
model, hands a ``PlacementProblem`` to ``planner.placement_ilp.ilp_placement``,
re-checks the answer (``check_placement``) and returns it as a ``Plan`` with
``placement == "general"``: one ``Stage`` per device used, holding that device's
layers in topological order (not necessarily consecutive), dp = tp = 1, pp = devices
used, one micro-batch. ``apply.wrap`` runs it with ``apply.pipeline.wrap_placed``.

Eligible (else no candidate): one node with at least two devices (the ILP gets
min(devices, ``MAX_DEVICES``) identical ones, any pair joined by the same link); at
most ``MAX_LAYERS`` layers; a *branchy* layer graph, i.e. two layers that no path
orders. Without such a pair every placement runs the layers one after another (plus
transfers), which is never faster than one device: that is what pipeline stages with
micro-batches are for.

The model (one batch B, no micro-batches):

- layer v: t_v = forward + backward for B samples (``SearchContext.layer_times_s(B)``);
  lumping a layer's forward and backward into one task keeps the critical path of
  F_u -> F_v -> B_v -> B_u (the backward mirrors the forward), so the makespan of
  the lumped schedule is that of forward + backward;
- edge u -> v on different devices: its tensor goes forward and its gradient comes
  back, c_uv = 2 x ``collectives.p2p_time_s``(bytes for B samples, the intra-node
  point-to-point link) (Hockney's alpha-beta model), as for pipeline boundaries;
  transfers are delays (no link contention);
- memory of device d: sum of its layers' ``SearchContext.layer_memories_bytes(B)`` (the
  ILP's constraint) plus, in the prediction, a received copy of every tensor that
  arrives from another device (``cost_model.with_margin_bytes``), as pipeline
  stages charge their received tensors;
- step = makespan + optimizer, where the optimizer updates run on every device at
  once: max over devices of ``cost_model.optimizer_time_s`` of its layers (as for
  pipeline stages). The breakdown follows the critical path of the schedule:
  compute_s = layer time on it, communication_s = transfers on it, bubble_s = any
  idle time left on it (zero for a left-shifted schedule).

A placement that uses one device, or whose makespan is not below the serial time
sum_v t_v (no branch overlaps another), is not offered: single device covers it.
"""
from __future__ import annotations

import math
from dataclasses import replace

import networkx as nx

from tfplan.planner import collectives as coll
from tfplan.planner import cost_model as cm
from tfplan.planner.context import SearchContext
from tfplan.core.errors import InfeasiblePlanError
from tfplan.planner.graph import layer_graph
from tfplan.planner.placement_ilp import (MAX_DEVICES, MAX_LAYERS, Placement, PlacementEdge,
                                   PlacementProblem, check_placement, ilp_placement)
from tfplan.planner.plan import Breakdown, Plan, Stage, Strategy
from tfplan.planner.topology import intra_node_p2p_link

# A placement is offered only if its makespan is below the serial time by more than this
# fraction: less is solver tolerance, not overlap.
MIN_OVERLAP_GAIN = 1e-6


def placement_plans(ctx: SearchContext, time_limit_s: float) -> list[Plan]:
    """The best general placement of ``ctx``'s model as a one-element list, or [] when
    the model or cluster is not eligible (module docstring) or nothing overlaps.

    ``time_limit_s``: the MILP's budget. When no placement fits memory, the fastest one
    regardless is returned, its prediction saying it does not fit.
    """
    if not eligible(ctx):
        return []
    problem = placement_problem(ctx)
    fits_note = ""
    try:
        placement = ilp_placement(problem, time_limit_s=time_limit_s)
    except InfeasiblePlanError:  # nothing fits: the fastest one regardless, marked so
        problem = replace(problem, memory_capacity_bytes=None)
        placement = ilp_placement(problem, time_limit_s=time_limit_s)
        fits_note = "; no placement fits memory, shown with the fastest regardless"
    placement = check_placement(problem, placement.device_of_layer, placement.start_s,
                                placement.solver)  # scipy issue 24141: never trust, re-check
    serial_s = sum(problem.layer_time_s)
    used = sorted(set(placement.device_of_layer))
    if len(used) < 2 or placement.makespan_s >= serial_s * (1 - MIN_OVERLAP_GAIN):
        return []
    return [_to_plan(ctx, problem, placement, serial_s, fits_note)]


def eligible(ctx: SearchContext) -> bool:
    """One node of >= 2 devices, 2..MAX_LAYERS layers, and two layers no path orders."""
    n = len(ctx.names)
    if ctx.units:  # blocks (placed whole) are not general placement's layers
        return False
    if ctx.cluster.num_nodes != 1 or ctx.cluster.num_devices < 2 or not 2 <= n <= MAX_LAYERS:
        return False
    closure = nx.transitive_closure_dag(layer_graph(ctx.profile))
    return closure.number_of_edges() < n * (n - 1) // 2  # some pair is unordered


def placement_problem(ctx: SearchContext) -> PlacementProblem:
    """The placement problem for the global batch on min(devices, MAX_DEVICES) devices."""
    p, batch = ctx.profile, ctx.global_batch
    link = intra_node_p2p_link(ctx.cluster)
    graph = layer_graph(p)
    position = {name: i for i, name in enumerate(ctx.names)}
    edges = tuple(
        PlacementEdge(src=u, dst=v, transfer_time_s=2 * coll.p2p_time_s(
            cm.scaled(data["bytes"], batch, p.batch_size), link))
        for u, v, data in sorted(graph.edges(data=True),
                                 key=lambda e: (position[e[0]], position[e[1]])))
    return PlacementProblem(
        layer_names=ctx.names, layer_time_s=ctx.layer_times_s(batch),
        layer_memory_bytes=ctx.layer_memories_bytes(batch), edges=edges,
        num_devices=min(ctx.cluster.num_devices, MAX_DEVICES),
        memory_capacity_bytes=ctx.cluster.device.memory_bytes)


def critical_path(problem: PlacementProblem, placement: Placement) -> tuple[float, float, float]:
    """(layer time, transfer time, idle time) along the schedule's critical path: from
    the last layer to finish back through, at each layer, the predecessor (a producer,
    or the layer before it on its device) whose result is ready last. They sum to the
    makespan."""
    n = problem.num_layers
    dev, start, finish = placement.device_of_layer, placement.start_s, placement.finish_s
    index = {name: i for i, name in enumerate(problem.layer_names)}
    producers: dict[int, dict[int, float]] = {v: {} for v in range(n)}
    for e in problem.edges:
        u, v = index[e.src], index[e.dst]
        producers[v][u] = producers[v].get(u, 0.0) + e.transfer_time_s
    before: dict[int, int] = {}
    for d in set(dev):
        seq = sorted((v for v in range(n) if dev[v] == d), key=lambda v: (start[v], finish[v], v))
        before.update({b: a for a, b in zip(seq, seq[1:])})
    compute_s = transfer_s = idle_s = 0.0
    v = max(range(n), key=lambda i: (finish[i], -i)) if n else None
    while v is not None:
        compute_s += problem.layer_time_s[v]
        ready = [(finish[u] + (c if dev[u] != dev[v] else 0.0), c if dev[u] != dev[v] else 0.0, u)
                 for u, c in producers[v].items()]
        if v in before:
            ready.append((finish[before[v]], 0.0, before[v]))
        if not ready:
            idle_s += start[v]
            break
        at_s, delay_s, u = max(ready)
        transfer_s += delay_s
        idle_s += max(0.0, start[v] - at_s)
        v = u
    return compute_s, transfer_s, idle_s


def _to_plan(ctx: SearchContext, problem: PlacementProblem, placement: Placement, serial_s: float,
             fits_note: str) -> Plan:
    p, batch = ctx.profile, ctx.global_batch
    # devices renamed in order of first use along the topological order: stage s on device s
    first_use = list(dict.fromkeys(placement.device_of_layer))
    device_of = [first_use.index(d) for d in placement.device_of_layer]
    k = len(first_use)
    names = ctx.cluster.device_names()[:k]
    members = [[v for v in range(len(ctx.names)) if device_of[v] == s] for s in range(k)]
    stages = tuple(Stage(layers=tuple(ctx.names[v] for v in vs), devices=(names[s],))
                   for s, vs in enumerate(members))
    memory = [sum(problem.layer_memory_bytes[v] for v in vs) for vs in members]
    for src, readers, nbytes in ctx.tensors:  # a received copy per device that reads it
        for s in sorted({device_of[r] for r in readers} - {device_of[src]}):
            memory[s] += cm.with_margin_bytes(cm.scaled(nbytes, batch, p.batch_size))
    optimizer_s = max(cm.optimizer_time_s(
        sum(p.layers[v].param_bytes for v in vs), sum(p.layers[v].grad_bytes for v in vs),
        sum(p.layers[v].optimizer_bytes for v in vs), ctx.cluster.device) for vs in members)
    compute_s, transfer_s, idle_s = critical_path(problem, placement)
    breakdown = Breakdown(compute_s=compute_s, communication_s=transfer_s, bubble_s=idle_s,
                          recompute_s=0.0, optimizer_s=optimizer_s)
    breakdown = cm.with_shared_cores(
        breakdown, [sum(problem.layer_time_s[v] for v in vs) + optimizer_s for vs in members],
        ctx.cluster)
    solver = (f"{placement.solver}; makespan {placement.makespan_s:.6g} s against "
              f"{serial_s:.6g} s with every layer in series{fits_note}")
    plan = ctx.plan(f"general placement on {k} devices",
                    Strategy(dp=1, tp=1, pp=k, microbatch_size=batch, num_microbatches=1,
                             schedule="gpipe"),
                    stages, breakdown, tuple((names[s], math.ceil(memory[s])) for s in range(k)),
                    solver, consecutive=False)
    return replace(plan, placement="general")
