"""A plan's devices grouped by the plan's structure -- pipeline stage, data-parallel
replica, tensor group, node -- never listed one by one: what every report shows so that
its size does not grow with the device count.

Pipeline position: between a ``Plan`` and the reports that draw it
(``reports.tensorboard``'s scalars and text, ``analysis.json`` for the dashboard,
``reports.images``). Plain values, no TensorFlow.

* ``stage_groups``: one ``StageGroup`` per pipeline stage (the devices of stage k of
  pp; an interleaved plan's chunks k, k + pp, ... share them): its devices named as
  ranges (``device_ranges``: "GPU:0..7 on nodes 24..35"), its layers and its peak
  memory (largest and smallest over its devices: they differ only where the plan makes
  them differ, e.g. uneven ZeRO shards).
* ``mesh``: the dp x tp x pp grid, pp rows by at most ``MAX_MESH_COLUMNS`` columns of
  data-parallel replicas (consecutive replicas merged into one column beyond that),
  each cell one representative device, its tensor group's size and its nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tfplan.planner.plan import Plan

MAX_MESH_COLUMNS = 16  # replica columns of the mesh grid; more replicas share a column


@dataclass(frozen=True)
class StageGroup:
    """The devices of one pipeline stage and what they hold."""

    stage: int
    devices: tuple[str, ...]
    where: str  # device_ranges(devices)
    layers: int  # layers on the stage (all its interleaved chunks)
    first_layer: str
    last_layer: str
    peak_memory_bytes: int  # the largest peak over the stage's devices
    min_memory_bytes: int  # the smallest (equal to the largest when all agree)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "devices": len(self.devices), "where": self.where,
                "layers": self.layers, "first_layer": self.first_layer,
                "last_layer": self.last_layer, "peak_memory_bytes": self.peak_memory_bytes,
                "min_memory_bytes": self.min_memory_bytes}


def _node_and_local(plan: Plan) -> dict[str, tuple[int, str]]:
    """Device name -> (node index, its name inside the node, e.g. "GPU:3")."""
    per_node = plan.cluster.devices_per_node
    return {d: (i // per_node, d.rsplit("/device:", 1)[-1])
            for i, d in enumerate(plan.cluster.device_names())}


def _ranges(values: Sequence[int]) -> str:
    """Sorted integers as "0..7" or "0..3, 8..11" (at most 4 runs, then "and N more")."""
    vs = sorted(set(values))
    runs: list[tuple[int, int]] = []
    for v in vs:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    text = [f"{a}..{b}" if b > a else str(a) for a, b in runs[:4]]
    if len(runs) > 4:
        text.append(f"and {len(runs) - 4} more runs")
    return ", ".join(text)


def _local_ranges(locals_: Sequence[str]) -> str:
    """["GPU:0", ..., "GPU:7"] -> "GPU:0..7"."""
    kinds = {x.rsplit(":", 1)[0] for x in locals_}
    if len(kinds) == 1 and all(x.rsplit(":", 1)[-1].isdigit() for x in locals_):
        return f"{kinds.pop()}:" + _ranges([int(x.rsplit(":", 1)[1]) for x in locals_])
    return ", ".join(sorted(set(locals_))[:4]) + (" ..." if len(set(locals_)) > 4 else "")


def device_ranges(plan: Plan, devices: Sequence[str], where: dict | None = None) -> str:
    """``devices`` in a few words, whatever their number: "GPU:0..7 on nodes 16..31" when
    every node holds the same local devices, else per node set; a single-node cluster
    names the local devices alone. Devices not in the cluster are counted."""
    where = where if where is not None else _node_and_local(plan)
    known = [where[d] for d in devices if d in where]
    unknown = len(devices) - len(known)
    extra = f" (+{unknown} devices outside the cluster)" if unknown else ""
    if not known:
        return f"{len(devices)} devices" if devices else "no device"
    per_node: dict[int, list[str]] = {}
    for node, local in known:
        per_node.setdefault(node, []).append(local)
    if plan.cluster.num_nodes == 1:
        return _local_ranges(per_node[0]) + extra
    shapes: dict[str, list[int]] = {}
    for node, locals_ in per_node.items():
        shapes.setdefault(_local_ranges(locals_), []).append(node)
    parts = [f"{local} on node{'s' if len(nodes) > 1 else ''} {_ranges(nodes)}"
             for local, nodes in list(shapes.items())[:3]]
    if len(shapes) > 3:
        parts.append(f"and {len(shapes) - 3} more node groups")
    return "; ".join(parts) + extra


def stage_groups(plan: Plan) -> list[StageGroup]:
    """One group per pipeline stage (module docstring), in stage order."""
    pp = max(1, min(plan.strategy.pp, len(plan.stages)))
    memory = dict(plan.predicted.peak_memory_bytes_per_device)
    where = _node_and_local(plan)
    out = []
    for k in range(pp):
        chunks = [st for j, st in enumerate(plan.stages) if j % pp == k]
        devices = plan.stages[k].devices
        layers = [name for st in chunks for name in st.layers]
        peaks = [memory[d] for d in devices if d in memory] or [0]
        out.append(StageGroup(k, tuple(devices), device_ranges(plan, devices, where),
                              len(layers), layers[0] if layers else "",
                              layers[-1] if layers else "", max(peaks), min(peaks)))
    return out


def mesh(plan: Plan) -> dict[str, Any]:
    """The dp x tp x pp grid (module docstring) as plain values for ``analysis.json``:
    ``{"dp", "tp", "pp", "cp", "ep", "virtual_stages", "devices", "nodes", "devices_per_node",
    "columns": [[first replica, last replica], ...], "rows": [{"stage", "layers", "where",
    "cells": [{"device", "devices", "nodes"}]}]}``; a cell's ``device`` is the first
    device of its first replica's tensor group, ``nodes`` the node range of all its
    devices."""
    s = plan.strategy
    tp = max(1, s.tp)
    where = _node_and_local(plan)
    groups = stage_groups(plan)
    replicas = max(1, len(plan.stages[0].devices) // tp) if plan.stages else 1
    per_column = -(-replicas // MAX_MESH_COLUMNS)
    columns = [(a, min(replicas, a + per_column) - 1) for a in range(0, replicas, per_column)]
    rows = []
    for g in groups:
        cells = []
        for a, b in columns:
            devices = g.devices[a * tp:(b + 1) * tp]
            nodes = sorted({where[d][0] for d in devices if d in where})
            cells.append({"device": devices[0] if devices else "", "devices": len(devices),
                          "nodes": _ranges(nodes) if nodes else ""})
        rows.append({"stage": g.stage, "layers": g.layers, "where": g.where,
                     "peak_memory_bytes": g.peak_memory_bytes, "cells": cells})
    return {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep,
            "virtual_stages": s.virtual_stages, "devices": len(plan.devices),
            "nodes": plan.cluster.num_nodes, "devices_per_node": plan.cluster.devices_per_node,
            "columns": [list(c) for c in columns], "rows": rows}
