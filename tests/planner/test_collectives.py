"""planner.collectives and planner.topology: one price per collective, for every caller.

The data-parallel gradient all-reduce over a group that spans nodes pays the
inter-node link, whether or not dp is a multiple of the devices per node, under both
layouts; plain data parallelism, the hybrids and the tensor-parallel ILP's gradient
term all price it with ``collectives.allreduce_time_s``.
"""
from __future__ import annotations

import ast
import os

import numpy as np
import pytest

from tfplan.core.cluster import LinkSpec
from tfplan.core.presets import parse_cluster
from tfplan.planner import collectives as coll
from tfplan.planner import cost_model as cm
from tfplan.planner.candidates import Choice
from tfplan.planner.context import search_context
from tfplan.planner.plan import stage_devices
from tfplan.planner.pricing import Pricer
from tfplan.planner.search import search
from tfplan.planner.topology import dp_group_devices, members_per_node
from tests.planner.test_search import chain_profile

INTRA = LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=5e-6)
INTER = LinkSpec(bandwidth_bytes_per_s=25e9, latency_s=1e-5)
GB = 1e9


def a100_3x8():
    return parse_cluster("3x8xA100-80GB")  # 3 DGX A100 nodes: NVLink inside, InfiniBand across


# --- the one all-reduce formula --------------------------------------------------------------

def test_allreduce_picks_ring_hierarchical_or_flat_ring_by_members_per_node():
    # one node: a ring on NVLink
    assert coll.allreduce_time_s(GB, (8,), INTRA, INTER) == coll.ring_allreduce_time_s(GB, 8, INTRA)
    assert coll.allreduce_time_s(GB, (0, 4, 0), INTRA, INTER) == \
        coll.ring_allreduce_time_s(GB, 4, INTRA)
    # the same members on every node: hierarchical, by hand
    by_hand = (7 / 8 * GB / 300e9 + 7 * 5e-6) + (2 * 2 / 3 * GB / 8 / 25e9 + 2 * 2 * 1e-5) \
        + (7 / 8 * GB / 300e9 + 7 * 5e-6)
    assert coll.allreduce_time_s(GB, (8, 8, 8), INTRA, INTER) == pytest.approx(by_hand)
    # one member per node: the plain inter-node ring
    assert coll.allreduce_time_s(GB, (1, 1), INTRA, INTER) == pytest.approx(
        coll.ring_allreduce_time_s(GB, 2, INTER))
    # unequal members (12 devices on 8-device nodes): a flat ring of 12 over InfiniBand
    assert coll.allreduce_time_s(GB, (8, 4), INTRA, INTER) == pytest.approx(
        2 * 11 / 12 * GB / 25e9 + 2 * 11 * 1e-5)
    # no inter-node link (one node): NVLink
    assert coll.allreduce_time_s(GB, (8,), INTRA, None) == coll.ring_allreduce_time_s(GB, 8, INTRA)


def test_members_per_node_and_dp_groups_match_the_plan_layouts():
    assert members_per_node(range(12), 8) == (8, 4)
    assert members_per_node((6, 8, 10), 8) == (1, 2)
    names = tuple(f"d{i}" for i in range(24))
    for layout in ("tp-dp-pp", "tp-pp-dp"):
        for dp, tp, pp in ((12, 1, 2), (3, 2, 4), (6, 2, 2), (2, 4, 3)):
            for s in range(pp):
                devices = stage_devices(names, layout, dp, tp, pp, s)  # replica-major, t inner
                for t in range(tp):
                    group = dp_group_devices(layout, dp, tp, pp, s, t)
                    assert tuple(names[d] for d in group) == devices[t::tp]


# --- the regression: dp = 12 on 3 x 8 A100 ------------------------------------------------------

def test_dp12_on_three_dgx_nodes_is_priced_across_nodes_everywhere():
    cluster = a100_3x8()
    intra, inter = cluster.intra_node_link, cluster.inter_node_link
    nbytes = 2 * GB
    function_s = coll.group_allreduce_time_s(nbytes, range(12), cluster)
    # 8 + 4 members: every ring step waits for InfiniBand, not an 8-way NVLink ring
    assert function_s >= coll.ring_allreduce_time_s(nbytes, 2, inter)
    assert function_s == pytest.approx(coll.ring_allreduce_time_s(nbytes, 12, inter))
    assert function_s > 10 * coll.ring_allreduce_time_s(nbytes, 8, intra)

    profile = chain_profile(n_layers=4, params=10_000_000, flops_fwd=10**9)
    ctx = search_context(profile, cluster, 48)
    pricer = Pricer(ctx)
    # hybrid dp=12 x pp=2, Megatron's layout: stage 0 on devices 0..11, stage 1 on 12..23
    megatron = Choice(12, 1, 2, 4, 1, "1f1b")
    per_stage = pricer.dp_allreduce_s(np.array([nbytes, nbytes]), megatron)
    assert list(per_stage) == [coll.group_allreduce_time_s(nbytes, range(12), cluster),
                               coll.group_allreduce_time_s(nbytes, range(12, 24), cluster)]
    assert min(per_stage) >= coll.ring_allreduce_time_s(nbytes, 2, inter)
    assert pricer.dp_allreduce_s(nbytes, megatron) == function_s  # stage 0, as tp_splits sees it

    # plain data parallelism dp=12 (fixed): devices 0..11, the same function
    plan = search(profile, cluster, 48, fix={"dp": 12}).chosen
    grad = sum(l.grad_bytes for l in profile.layers)
    overlap = sum(cm.layer_fwd_bwd_time_s(l, 4, profile.batch_size, cluster.device,
                                          profile.precision)[1] for l in profile.layers[1:])
    allreduce_s = coll.group_allreduce_time_s(grad, range(12), cluster)
    assert plan.predicted.breakdown.communication_s == pytest.approx(
        cm.exposed_allreduce_s(allreduce_s, overlap))
    assert allreduce_s >= coll.ring_allreduce_time_s(grad, 2, inter)


def test_dp_outer_groups_spanning_nodes_unevenly_ring_over_the_inter_node_link():
    cluster = a100_3x8()
    inter = cluster.inter_node_link
    pricer = Pricer(search_context(chain_profile(n_layers=6), cluster, 48))
    # tp pp = 3 does not divide 8: replicas at 0, 3, ..., 21 -> 3 + 3 + 2 per node
    uneven = Choice(8, 1, 3, 2, 3, "1f1b", layout="tp-pp-dp")
    assert members_per_node(dp_group_devices("tp-pp-dp", 8, 1, 3, 0), 8) == (3, 3, 2)
    assert pricer.dp_allreduce_s(GB, uneven) == pytest.approx(
        coll.ring_allreduce_time_s(GB, 8, inter))
    # tp pp = 2: 4 replicas on each of the 3 nodes, dp = 12 not a multiple of 8: hierarchical
    even = Choice(12, 1, 2, 4, 1, "1f1b", layout="tp-pp-dp")
    assert pricer.dp_allreduce_s(GB, even) == pytest.approx(
        coll.hierarchical_allreduce_time_s(GB, 4, 3, cluster.intra_node_link, inter))


def test_megatron_stage_straddling_a_node_boundary_pays_the_inter_node_link():
    cluster = a100_3x8()
    pricer = Pricer(search_context(chain_profile(n_layers=8), cluster, 48))
    # dp tp = 6: stage 0 on devices 0..5 (one node), stage 1 on 6..11 (two nodes)
    c = Choice(3, 2, 4, 4, 1, "1f1b")
    per_stage = pricer.dp_allreduce_s(np.full(4, GB), c)
    assert per_stage[0] == pytest.approx(coll.ring_allreduce_time_s(GB, 3, cluster.intra_node_link))
    assert per_stage[1] == pytest.approx(coll.ring_allreduce_time_s(GB, 3, cluster.inter_node_link))


# --- one module prices links ---------------------------------------------------------------------

def test_only_collectives_reads_a_links_bandwidth_or_latency():
    folder = os.path.dirname(os.path.abspath(cm.__file__))
    readers = set()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            if any(isinstance(n, ast.Attribute) and n.attr in ("bandwidth_bytes_per_s",
                                                                "latency_s")
                   for n in ast.walk(tree)):
                readers.add(name)
    assert readers == {"collectives.py"}
