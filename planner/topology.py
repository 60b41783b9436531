"""Link topology: which devices a strategy's groups hold, and which link joins two of them.

Pipeline position: below the pricing modules. ``planner.collectives`` reads
``members_per_node`` of a group to price its all-reduce; ``planner.pricing`` (the
hybrids), ``planner.search`` (plain data parallelism and GPipe) and
``planner.placement_search`` ask here which point-to-point link a pipeline boundary or
a transfer crosses and which devices a data-parallel group holds. Pure functions of a
``ClusterSpec`` and device indices (node-major: device i is on node i //
devices_per_node); no pricing here.

Device layouts (``planner.plan.stage_devices``; devices node-major, d per node):

- "tp-dp-pp" (Megatron-LM's order): stage s, replica r, tensor rank t on device
  s dp tp + r tp + t. The dp group of a stage has stride tp: inside a node when its
  dp tp devices are (dp tp <= d and the stage does not straddle a node boundary),
  else across nodes with d / tp members in each node it fills. The pipeline is
  outermost, so a stage boundary crosses nodes when its two stages' groups are on
  different nodes. Megatron-LM chooses this because a boundary moves only one
  micro-batch's activations point to point, 2 m A / tp bytes per rank per step
  (A: boundary activation bytes per micro-batch; forward and back), while the
  all-reduce moves every gradient of the stage, 2 (n-1)/n G bytes per device
  (Narayanan et al., SC'21, Sec. 3, takeaways #1 and #2: tensor parallelism inside a
  node, pipeline parallelism to scale across nodes, data parallelism on top).
- "tp-pp-dp" ("dp-outer", dp outermost): device r tp pp + s tp + t, replica r's whole
  pipeline on devices [r tp pp, (r+1) tp pp). When tp pp divides d every replica is
  inside one node and every pipeline send stays on the intra-node link; the price is
  paid by the all-reduce instead: its group has stride tp pp, k = d / (tp pp) members
  per node. This is the layout a multi-worker hybrid in ``apply`` needs (each replica
  inside one worker: dp across workers with MultiWorkerMirroredStrategy, the pipeline
  and tp inside).

How a group's all-reduce is priced from its ``members_per_node``:
``planner.collectives.allreduce_time_s``.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from tfplan.core.cluster import ClusterSpec, LinkSpec
from tfplan.planner.plan import LAYOUTS


def dp_group_devices(layout: str, dp: int, tp: int, pp: int, stage: int,
                     rank: int = 0) -> tuple[int, ...]:
    """Device indices of the data-parallel group of pipeline stage ``stage`` (< pp) and
    tensor rank ``rank`` (< tp) under ``layout``: replica r's device, r = 0..dp-1
    (module docstring; the same devices ``planner.plan.stage_devices`` names). The tp
    groups of a stage are this one shifted by the rank; as tp divides devices_per_node
    they touch the same nodes alike."""
    if layout == "tp-dp-pp":
        return tuple(stage * dp * tp + r * tp + rank for r in range(dp))
    if layout == "tp-pp-dp":
        return tuple(r * tp * pp + stage * tp + rank for r in range(dp))
    raise ValueError(f"layout {layout!r}; expected one of {LAYOUTS}")


def members_per_node(devices: Iterable[int], devices_per_node: int) -> tuple[int, ...]:
    """How many of ``devices`` (node-major indices) each node holds, for the nodes that
    hold any, in node order: (8, 4) for devices 0..11 on 8-device nodes."""
    counts = Counter(d // devices_per_node for d in devices)
    return tuple(counts[node] for node in sorted(counts))


def link_between(cluster: ClusterSpec, a: int, b: int, group: int = 1) -> LinkSpec:
    """Point-to-point link between pipeline devices ``a`` and ``b`` when each is a group
    of ``group`` consecutive devices (node-major): inside a node or across nodes
    (``ClusterSpec.p2p_link``). group = 1: between devices a and b themselves."""
    same = a * group // cluster.devices_per_node == b * group // cluster.devices_per_node
    return cluster.p2p_link(same_node=same)


def stage_link(cluster: ClusterSpec, layout: str, dp: int, tp: int, pp: int, a: int,
               b: int) -> LinkSpec:
    """Point-to-point link from pipeline stage ``a`` to stage ``b`` under ``layout``.
    tp-dp-pp: stage groups of dp tp devices (``link_between``). tp-pp-dp: replica r's
    stage s starts at r tp pp + s tp; the slowest link over the replicas (inside a node
    for all of them when tp pp divides devices_per_node)."""
    if layout != "tp-pp-dp":
        return link_between(cluster, a, b, dp * tp)
    per_node = cluster.devices_per_node
    same = all((r * tp * pp + a * tp) // per_node == (r * tp * pp + b * tp) // per_node
               for r in range(dp))
    return cluster.p2p_link(same_node=same)


def intra_node_p2p_link(cluster: ClusterSpec) -> LinkSpec:
    """The link one transfer inside a node crosses (``ClusterSpec.p2p_link`` where the
    cluster has it, else the intra-node link)."""
    pick = getattr(cluster, "p2p_link", None)
    return pick(True) if callable(pick) else cluster.intra_node_link
