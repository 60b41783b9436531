"""Device layouts of hybrid plans (``Strategy.layout``): Megatron-LM's tp-dp-pp and
dp-outer tp-pp-dp -- device lists, pricing (``planner.pricing``), the search's
enumeration and knob, and plan.json."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from tfplan.planner import collectives as coll
from tfplan.core.cluster import ClusterSpec, LinkSpec
from tfplan.core.errors import PlanMismatchError, PlannerError, SchemaError
from tfplan.planner.plan import LAYOUTS, Plan, load_plan, save_plan, stage_devices
from tfplan.core.presets import parse_cluster
from tfplan.planner.candidates import Choice, dp_outer_differs, hybrid_choices
from tfplan.planner.context import search_context
from tfplan.planner.pricing import Pricer
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tests.planner.gpt_profile import gpt_profile
from tests.planner.test_search import MB, chain_profile, make_cluster

W = "/job:worker/task:{}/device:{}:{}"


def two_nodes(per_node: int = 4, inter_bytes_per_s: float = 1e9) -> ClusterSpec:
    """2 nodes of ``per_node`` test GPUs, 100 GB/s inside a node, ``inter_bytes_per_s``
    between nodes (slow by default)."""
    one = make_cluster(num_devices=per_node, memory_bytes=10**12)
    return dataclasses.replace(one, name="2xtest", num_nodes=2,
                               inter_node_link=LinkSpec(inter_bytes_per_s, 10e-6))


def node_of(device: str) -> str:
    return device.split("/device:")[0]


# --- device lists --------------------------------------------------------------------------

def test_device_lists_on_two_workers_of_two_cpus():
    devices = parse_cluster("2xcpu:2").device_names()
    cpu = [[W.format(w, "CPU", i) for i in range(2)] for w in range(2)]
    # Megatron: stage s on worker s, its two replicas side by side
    assert [stage_devices(devices, "tp-dp-pp", 2, 1, 2, s) for s in range(2)] == \
        [(cpu[0][0], cpu[0][1]), (cpu[1][0], cpu[1][1])]
    # dp-outer: replica r (position r of every stage) on worker r, stage s on its CPU s
    assert [stage_devices(devices, "tp-pp-dp", 2, 1, 2, s) for s in range(2)] == \
        [(cpu[0][0], cpu[1][0]), (cpu[0][1], cpu[1][1])]


def test_device_lists_on_two_dgx_nodes_dp4_pp2_tp2():
    cluster = parse_cluster("2x8xA100-80GB")
    devices = cluster.device_names()
    g = [[W.format(n, "GPU", i) for i in range(8)] for n in range(2)]
    dp, tp, pp = 4, 2, 2
    megatron = [stage_devices(devices, "tp-dp-pp", dp, tp, pp, s) for s in range(pp)]
    outer = [stage_devices(devices, "tp-pp-dp", dp, tp, pp, s) for s in range(pp)]
    assert megatron == [tuple(g[0]), tuple(g[1])]  # a node per stage
    # replica r: devices [4r, 4r + 4); stage s of it at 4r + 2s, tp ranks innermost
    assert outer[0] == (g[0][0], g[0][1], g[0][4], g[0][5], g[1][0], g[1][1], g[1][4], g[1][5])
    assert outer[1] == (g[0][2], g[0][3], g[0][6], g[0][7], g[1][2], g[1][3], g[1][6], g[1][7])
    for r in range(dp):  # every replica's tp ranks of every stage inside one node
        assert len({node_of(d) for st in outer for d in st[r * tp:(r + 1) * tp]}) == 1
        assert len({node_of(d) for st in megatron for d in st[r * tp:(r + 1) * tp]}) == 2


def test_layouts_place_alike_exactly_when_dp_or_pp_is_one():
    devices = tuple(str(i) for i in range(64))
    for dp, tp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4)):
        same = all(stage_devices(devices, "tp-dp-pp", dp, tp, pp, s)
                   == stage_devices(devices, "tp-pp-dp", dp, tp, pp, s) for s in range(pp))
        assert same == (dp == 1 or pp == 1), (dp, tp, pp)
        for layout in LAYOUTS:  # a grid: every device once
            used = [d for s in range(pp) for d in stage_devices(devices, layout, dp, tp, pp, s)]
            assert sorted(used, key=int) == list(devices[:dp * tp * pp])


def test_fixed_search_places_plans_by_layout_and_they_validate():
    profile = gpt_profile(4, 512, 8, vocab=4096, seq=256)
    cluster = parse_cluster("2x8xA100-80GB")
    for layout in LAYOUTS:
        for schedule in ("1f1b", "interleaved"):
            plan = search(profile, cluster, 32, fix={"dp": 4, "tp": 2, "pp": 2,
                                                     "layout": layout,
                                                     "schedule": schedule}).chosen
            validate_plan(plan, profile)
            s = plan.strategy
            assert s.layout == layout and ("dp-outer" in plan.name) == (layout == "tp-pp-dp")
            devices = cluster.device_names()
            for k, stage in enumerate(plan.stages):  # interleaved: chunk k on stage k % pp's
                assert stage.devices == stage_devices(devices, layout, 4, 2, 2, k % 2)


# --- pricing -------------------------------------------------------------------------------

def _pricer(profile, cluster, batch):
    return Pricer(search_context(profile, cluster, batch))


def test_dp_outer_moves_the_allreduce_across_nodes_and_the_sends_inside():
    cluster = two_nodes()
    profile = chain_profile(n_layers=4, params=100_000, flops_fwd=10**6)
    pricer = _pricer(profile, cluster, 32)
    megatron = Choice(4, 1, 2, 4, 2, "1f1b")
    outer = dataclasses.replace(megatron, layout="tp-pp-dp")
    dm = pricer.devices(1, 4, 2, "none", 1, 4, "tp-dp-pp")
    do = pricer.devices(1, 4, 2, "none", 1, 4, "tp-pp-dp")
    for key in ("fwd", "bwd", "grad", "param", "cw", "opt", "kept"):  # only the comm terms differ
        assert list(dm[key]) == list(do[key])
    # the one boundary (stage 0 -> 1): across nodes in Megatron's order, inside in dp-outer
    nbytes = 32_768 * 4 / 8  # the boundary activation of a 4-sample micro-batch
    intra, inter = cluster.intra_node_link, cluster.inter_node_link
    assert dm["send"][0] == pytest.approx(2 * coll.p2p_time_s(nbytes, cluster.p2p_link(False)))
    assert do["send"][0] == pytest.approx(2 * coll.p2p_time_s(nbytes, cluster.p2p_link(True)))
    assert do["send"][0] < dm["send"][0]
    # the gradient all-reduce: a ring of 4 inside a node vs 2 per node x 2 nodes
    grad = dm["grad"][0]
    assert pricer.dp_allreduce_s(grad, megatron) == pytest.approx(
        coll.ring_allreduce_time_s(grad, 4, intra))
    assert pricer.dp_allreduce_s(grad, outer) == pytest.approx(
        coll.hierarchical_allreduce_time_s(grad, 2, 2, intra, inter))
    assert pricer.dp_allreduce_s(grad, outer) > pricer.dp_allreduce_s(grad, megatron)


def test_one_replica_per_node_rings_over_the_inter_node_link():
    cluster = two_nodes()
    pricer = _pricer(chain_profile(n_layers=4), cluster, 32)
    outer = Choice(2, 1, 4, 4, 4, "1f1b", layout="tp-pp-dp")  # tp pp = 4 = a node
    assert pricer.dp_allreduce_s(1e6, outer) == pytest.approx(
        coll.ring_allreduce_time_s(1e6, 2, cluster.inter_node_link))


@pytest.mark.parametrize("heavy, faster", [("gradients", "tp-dp-pp"),
                                           ("activations", "tp-pp-dp")])
def test_prices_differ_in_the_expected_direction(heavy, faster):
    # little compute, so nothing hides the communication; a slow inter-node link.
    # Many parameters and small activations: dp-outer's cross-node all-reduce costs more
    # than Megatron's cross-node sends; few parameters and big activations: the reverse.
    if heavy == "gradients":
        profile = chain_profile(n_layers=4, params=10**6, activation_bytes=1024,
                                flops_fwd=10**6)
    else:
        profile = chain_profile(n_layers=4, params=100, activation_bytes=8 * MB,
                                flops_fwd=10**6)
    cluster = two_nodes()
    pricer = _pricer(profile, cluster, 32)
    megatron = Choice(4, 1, 2, 4, 2, "1f1b")
    comm = {c.layout: pricer.estimate(c).breakdown.communication_s
            for c in (megatron, dataclasses.replace(megatron, layout="tp-pp-dp"))}
    slower = "tp-pp-dp" if faster == "tp-dp-pp" else "tp-dp-pp"
    assert comm[faster] < comm[slower]
    # the search, with the shape fixed and the layout free, takes the cheaper one
    chosen = search(profile, cluster, 32, fix={"dp": 4, "pp": 2}).chosen
    assert chosen.strategy.layout == faster


def test_in_one_node_the_layouts_price_alike():
    cluster = make_cluster(num_devices=8)
    pricer = _pricer(chain_profile(n_layers=4), cluster, 32)
    a = Choice(4, 1, 2, 4, 2, "1f1b")
    ea, eb = pricer.estimate(a), pricer.estimate(dataclasses.replace(a, layout="tp-pp-dp"))
    assert ea.breakdown == eb.breakdown and ea.stage_memory_bytes == eb.stage_memory_bytes


# --- which shapes get both layouts -----------------------------------------------------------

@pytest.mark.parametrize("nodes, per_node, shape, expected", [
    (1, 8, (2, 1, 2), False),  # one node: every link intra, same price
    (2, 4, (2, 1, 2), False),  # 4 devices of node 0 only: same price
    (2, 4, (4, 1, 2), True),
    (2, 4, (2, 1, 4), True),   # a replica fills a node
    (2, 4, (2, 2, 2), True),
    (2, 4, (8, 1, 1), False),  # pp = 1: the same devices
    (2, 4, (1, 1, 8), False),  # dp = 1: the same devices
    (2, 4, (4, 2, 1), False),
    (2, 4, (1, 2, 4), False),
    (2, 4, (1, 1, 8), False),
    (3, 2, (2, 1, 3), False),  # tp pp = 3 does not divide a node: replicas would straddle
    (2, 4, (1, 4, 2), False),
])
def test_dp_outer_is_offered_exactly_where_it_differs_and_keeps_replicas_in_a_node(
        nodes, per_node, shape, expected):
    cluster = dataclasses.replace(two_nodes(per_node), num_nodes=nodes)
    assert dp_outer_differs(cluster, *shape) is expected


def test_hybrid_choices_enumerate_dp_outer_only_where_it_differs():
    profile = chain_profile(n_layers=8)
    for cluster in (two_nodes(), make_cluster(num_devices=8)):
        ctx = search_context(profile, cluster, 32)
        choices = hybrid_choices(ctx, {}, skip_classic=True)
        shapes = {(c.dp, c.tp, c.pp) for c in choices}
        outer = {(c.dp, c.tp, c.pp) for c in choices if c.layout == "tp-pp-dp"}
        assert outer == {s for s in shapes if dp_outer_differs(cluster, *s)}
        assert bool(outer) == (cluster.num_nodes > 1)
        # the same knobs under each layout
        strip = lambda c: dataclasses.replace(c, layout="tp-dp-pp")  # noqa: E731
        assert {strip(c) for c in choices if c.layout == "tp-pp-dp"} <= set(choices)


def test_search_ranks_both_layouts_and_the_knob_fixes_one():
    profile = chain_profile(n_layers=4, params=1000, activation_bytes=4 * MB, flops_fwd=10**8)
    cluster = two_nodes()
    names = [p.name for p in search(profile, cluster, 32).candidates]
    assert any("dp-outer" in n for n in names) and \
        any("hybrid" in n and "pp=1" not in n and "dp=1 " not in n and "dp-outer" not in n
            for n in names)
    for layout in LAYOUTS:
        result = search(profile, cluster, 32, fix={"layout": layout})
        hybrids = [p.strategy for p in result.candidates if p.strategy.dp > 1
                   and p.strategy.pp > 1]
        assert hybrids and all(s.layout == layout for s in hybrids)
        assert all(s.layout == "tp-dp-pp" for p in result.candidates
                   for s in [p.strategy] if s.dp == 1 or s.pp == 1)


def test_bad_layout_knob_is_a_planner_error():
    with pytest.raises(PlannerError, match="layout='dp-tp-pp'"):
        search(chain_profile(), two_nodes(), 32, fix={"layout": "dp-tp-pp"})


# --- plan.json -----------------------------------------------------------------------------

def test_plan_json_round_trips_the_layout_and_defaults_when_absent(tmp_path):
    profile = chain_profile(n_layers=4)
    plan = search(profile, two_nodes(), 32, fix={"dp": 4, "pp": 2, "layout": "tp-pp-dp"}).chosen
    assert plan.to_dict()["strategy"]["layout"] == "tp-pp-dp"
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    doc = plan.to_dict()
    del doc["strategy"]["layout"]  # a plan file from before layouts
    assert Plan.from_dict(doc).strategy.layout == "tp-dp-pp"
    doc["strategy"]["layout"] = "pp-dp-tp"
    with pytest.raises(SchemaError, match="layout"):
        Plan.from_dict(json.loads(json.dumps(doc)))
    bad = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, layout="x"))
    with pytest.raises(PlanMismatchError, match="layout"):
        validate_plan(bad, profile)


def test_replicas_inside_nodes_tells_the_layouts_apart():
    profile = chain_profile(n_layers=8)
    cluster = two_nodes()
    inside = {}
    for layout in LAYOUTS:
        for dp, tp, pp in ((4, 1, 2), (2, 2, 2), (8, 1, 1), (1, 1, 8)):
            plan = search(profile, cluster, 32, fix={"dp": dp, "tp": tp, "pp": pp,
                                                     "layout": layout}).chosen
            inside[layout, dp, tp, pp] = plan.replicas_inside_nodes()
            assert {d for r in range(dp) for d in plan.replica_devices(r)} == set(plan.devices)
    assert inside["tp-pp-dp", 4, 1, 2] and inside["tp-pp-dp", 2, 2, 2]
    assert not inside["tp-dp-pp", 4, 1, 2] and not inside["tp-dp-pp", 2, 2, 2]
    assert inside["tp-dp-pp", 8, 1, 1] and inside["tp-pp-dp", 8, 1, 1]  # one device each
    assert not inside["tp-dp-pp", 1, 1, 8]  # one replica over both nodes
