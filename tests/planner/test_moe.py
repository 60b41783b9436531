"""Expert parallelism in the planner (``planner.experts``, the all-to-all in
``planner.collectives``, pricing, search, validation): closed forms by hand on tiny numbers,
the search's choice of ep, --fix ep=N and plan files with ep."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from tfplan.core.cluster import ClusterSpec, DeviceSpec, LinkSpec
from tfplan.core.errors import PlannerError, SchemaError, SolverError
from tfplan.core.presets import parse_cluster
from tfplan.planner import collectives as coll
from tfplan.planner import experts
from tfplan.planner.candidates import Choice
from tfplan.planner.context import search_context
from tfplan.planner.plan import Plan
from tfplan.planner.pricing import Pricer
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tests.planner.gpt_profile import gpt_profile
from tests.planner.moe_profile import moe_gpt_profile
from tests.planner.test_search import chain_profile, make_cluster

INTRA = LinkSpec(100e9, 5e-6)
INTER = LinkSpec(25e9, 10e-6)


# --- the all-to-all ------------------------------------------------------------------------

def test_all_to_all_inside_a_node_is_the_pairwise_exchange_closed_form():
    # n = 4 ranks, N = 8 MB each: 3 slices of 2 MB, each alpha + 2e6 / beta
    n, nbytes = 4, 8e6
    expected = (n - 1) * (5e-6 + (nbytes / n) / 100e9)
    assert coll.all_to_all_time_s(nbytes, (4,), INTRA, INTER) == pytest.approx(expected)
    assert expected == pytest.approx(3 * (5e-6 + 2e-5))
    assert coll.all_to_all_time_s(nbytes, (1,), INTRA, INTER) == 0.0


def test_all_to_all_across_nodes_is_paced_by_the_slower_set_of_links():
    # 16 ranks, 8 per node on 2 nodes, N = 16 MB: slices of 1 MB; 7 over NVLink, 8 over IB
    nbytes = 16e6
    intra = 7 * (5e-6 + 1e6 / 100e9)
    inter = 8 * (10e-6 + 1e6 / 25e9)
    assert coll.all_to_all_time_s(nbytes, (8, 8), INTRA, INTER) == pytest.approx(
        max(intra, inter))
    assert max(intra, inter) == pytest.approx(inter) == pytest.approx(8 * 50e-6)
    # unequal members (8 + 4): the rank on the emptier node sends 12 - 4 = 8 across
    share = nbytes / 12
    assert coll.all_to_all_time_s(nbytes, (8, 4), INTRA, INTER) == pytest.approx(
        max(3 * (5e-6 + share / 100e9), 8 * (10e-6 + share / 25e9)))


# --- the expert numbers ----------------------------------------------------------------------

def _tiny_moe(**kw):
    return moe_gpt_profile(2, 64, 4, experts=8, ffn=128, vocab=100, seq=16, batch=2, **kw)


def test_expert_degrees_divide_dp_and_every_layers_experts():
    p = _tiny_moe()
    assert experts.expert_degrees(p, 12) == [1, 2, 4]  # 8 experts: not 3, 6, 12
    assert experts.expert_degrees(chain_profile(), 8) == [1]
    with pytest.raises(PlannerError, match="needs a mixture-of-experts layer; the model"):
        experts.check_expert_degree(chain_profile(), 2, 4)
    with pytest.raises(PlannerError, match="does not divide dp=6"):
        experts.check_expert_degree(p, 4, 6)
    with pytest.raises(PlannerError, match="does not divide the 8 experts"):
        experts.check_expert_degree(p, 16, 16)


def test_dispatch_bytes_and_capacity_padding_by_hand():
    p = _tiny_moe(capacity_factor=1.25, top_k=2)
    moe = p.layers[[l.name for l in p.layers].index("moe_0")]
    # T = 2 x 16 = 32 tokens, k = 2, h = 64, float16: D = 32 * 2 * 64 * 2 = 8192 bytes
    assert moe.moe_dispatch_bytes == 8192
    # 1 sample of the profile's 2, padded by cf 1.25
    assert experts.dispatch_bytes(moe, 1, 2) == pytest.approx(8192 / 2 * 1.25)
    f_exp = 2 * 32 * 2 * 2 * 64 * 128
    assert moe.moe_expert_flops_fwd == f_exp
    assert experts.padded_expert_flops(moe) == pytest.approx((0.25 * f_exp, 0.5 * f_exp))
    assert experts.expert_share(moe) == pytest.approx(8 * 2 * 64 * 128 / moe.params)
    assert experts.padded_expert_flops(p.layers[0]) == (0.0, 0.0)


def test_without_a_capacity_factor_the_buffer_apply_runs_is_priced():
    """No capacity factor: the dispatch buffer keeps C = T rows per expert (nothing
    dropped), E T rows for the routed T k: c = E / k = 4 for 8 experts, top 2 -- in the
    all-to-all bytes and the expert FLOPs alike."""
    p = _tiny_moe(capacity_factor=0.0, top_k=2)
    moe = p.layers[[l.name for l in p.layers].index("moe_0")]
    assert experts.capacity_scale(moe) == 4.0
    assert experts.dispatch_bytes(moe, 2, 2) == pytest.approx(4 * moe.moe_dispatch_bytes)
    f_exp = moe.moe_expert_flops_fwd
    assert experts.padded_expert_flops(moe) == pytest.approx((3 * f_exp, 6 * f_exp))


def test_expert_groups_of_a_data_parallel_group():
    group = tuple(range(100, 108))  # dp = 8 replicas, cp = 1
    assert experts.expert_group_devices(group, 4) == ((100, 101, 102, 103), (100, 104))
    group = tuple(range(8))  # dp = 4, cp = 2: replica r, context rank c at 2 r + c
    assert experts.expert_group_devices(group, 2, cp=2) == ((0, 2), (0, 1, 4, 5))


# --- pricing -------------------------------------------------------------------------------

def _big_cluster(nodes: int = 2, memory_bytes: int = 10**12) -> ClusterSpec:
    device = DeviceSpec(kind="TestGPU", device_type="GPU", memory_bytes=memory_bytes,
                        peak_flops_per_s=(("float16", 100e12), ("float32", 10e12)),
                        memory_bandwidth_bytes_per_s=1e12, matmul_efficiency=0.5)
    return ClusterSpec(name="test", num_nodes=nodes, devices_per_node=4, device=device,
                       intra_node_link=INTRA, inter_node_link=INTER)


def test_expert_state_is_divided_by_ep_exactly():
    p = _tiny_moe()
    cluster = _big_cluster()
    pricer = Pricer(search_context(p, cluster, 8))
    held = {}
    for ep in (1, 2, 4, 8):
        c = Choice(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1, ep=ep)
        d = pricer.devices(1, 1, 1, "none", 1, 8, ep=ep)
        held[ep] = float(pricer._state(d, c, 0)[0][0])
    expert_state = sum(l.state_bytes * experts.expert_share(l) for l in p.layers)
    assert held[1] == pytest.approx(p.state_bytes)
    for ep in (2, 4, 8):
        assert held[ep] == pytest.approx(p.state_bytes - expert_state * (1 - 1 / ep))


def test_zero1_shards_expert_optimizer_state_over_dp_over_ep():
    p = _tiny_moe()
    pricer = Pricer(search_context(p, _big_cluster(), 8))
    c = Choice(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1, zero_stage=1, ep=2)
    d = pricer.devices(1, 1, 1, "none", 1, 8, ep=2)
    held = float(pricer._state(d, c, 1)[0][0])
    x = {n: sum(getattr(l, n) * experts.expert_share(l) for l in p.layers)
         for n in ("param_bytes", "compute_weight_bytes", "grad_bytes", "optimizer_bytes")}
    total = {n: sum(getattr(l, n) for l in p.layers) for n in x}
    dense = {n: total[n] - x[n] for n in x}
    # dense: W + Wc + G + S / 8; experts (/ ep = 2): W + Wc + G + S / (8 / 2)
    expected = dense["param_bytes"] + dense["compute_weight_bytes"] + dense["grad_bytes"] \
        + dense["optimizer_bytes"] / 8 \
        + (x["param_bytes"] + x["compute_weight_bytes"] + x["grad_bytes"]) / 2 \
        + x["optimizer_bytes"] / 2 / 4
    assert held == pytest.approx(expected)


def test_all_to_all_time_in_the_estimate_by_hand():
    p = _tiny_moe()
    cluster = _big_cluster()
    pricer = Pricer(search_context(p, cluster, 8))
    # dp = 8 on 2 nodes of 4, ep = 8: the ep group spans both nodes, 4 + 4
    e = pricer.estimate(Choice(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1, ep=8))
    moe = [l for l in p.layers if l.is_moe]
    per_layer = coll.all_to_all_time_s(experts.dispatch_bytes(moe[0], 1, 2), (4, 4), INTRA,
                                       INTER)
    assert e.all_to_all_s == pytest.approx(4 * len(moe) * per_layer)
    e1 = pricer.estimate(Choice(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1))
    assert e1.all_to_all_s == 0.0
    plan = pricer.to_plan(e)
    assert plan.strategy.ep == 8 and plan.predicted.all_to_all_s == pytest.approx(
        e.all_to_all_s)
    assert plan.predicted.breakdown.communication_s >= e.all_to_all_s


def test_expert_gradients_all_reduce_over_dp_over_ep():
    p = _tiny_moe()
    cluster = _big_cluster()
    pricer = Pricer(search_context(p, cluster, 8))
    c = Choice(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1, ep=2)
    d = pricer.devices(1, 1, 1, "none", 1, 8, ep=2)
    allreduce = float(pricer._dp_collectives(d, c)[0][0])
    dense = float(d["dense_grad"][0])
    expert = float(d["expert_grad"][0])  # already / ep
    # dense over 8 ranks on 2 nodes (4 + 4, hierarchical); experts over replicas 0, 2, 4, 6
    expected = coll.allreduce_time_s(dense, (4, 4), INTRA, INTER) \
        + coll.allreduce_time_s(expert, (2, 2), INTRA, INTER)
    assert allreduce == pytest.approx(expected)


# --- the search ------------------------------------------------------------------------------

def test_models_without_experts_plan_with_ep_1_as_before():
    profile = gpt_profile(4, 256, 4, vocab=1000, seq=128, batch=1)
    result = search(profile, parse_cluster("2x8xA100-80GB"), 32)
    assert all(p.strategy.ep == 1 for p in result.candidates)
    assert "ep=" not in result.chosen.reason and "xpert" not in result.chosen.reason
    assert "all_to_all_s" not in result.chosen.predicted.to_dict()


def test_search_splits_experts_that_do_not_fit_replicated_and_says_why():
    # 8 blocks of 256 experts (h 1024, ffn 4096): 2.1e9 expert params per layer, 17e9 in
    # all, ~300 GB of state: no 80 GB device holds a replica's experts
    profile = moe_gpt_profile(8, 1024, 16, experts=256, ffn=4096, seq=1024)
    result = search(profile, parse_cluster("4x8xA100-80GB"), 64)
    chosen = result.chosen
    assert chosen.predicted.fits and chosen.strategy.ep > 1
    assert f"ep={chosen.strategy.ep}" in chosen.name
    assert chosen.predicted.all_to_all_s > 0
    reason = chosen.reason
    assert f"Expert parallelism ep={chosen.strategy.ep}" in reason
    assert "if every replica held every expert, more than the 80.00 GiB a device has" in reason
    assert "token all-to-alls" in reason and "without expert parallelism" in reason
    validate_plan(chosen, profile)


def test_search_keeps_ep_1_when_experts_fit_and_says_so():
    # a few MiB of experts on 1 TB devices: the all-to-alls would only cost time
    profile = _tiny_moe()
    result = search(profile, _big_cluster(), 8)
    assert result.chosen.strategy.ep == 1
    reason = result.chosen.reason
    assert "No expert parallelism (ep=1): every data-parallel replica holds all the " \
           "experts" in reason
    assert "the fastest plan with expert parallelism, hybrid" in reason
    assert any(p.strategy.ep > 1 for p in result.candidates)


def test_fix_ep():
    profile = moe_gpt_profile(2, 256, 4, experts=16, ffn=512, seq=128)
    cluster = parse_cluster("2x8xA100-80GB")
    result = search(profile, cluster, 16, fix={"dp": 16, "ep": 8})
    assert result.chosen.strategy.ep == 8 and result.chosen.strategy.dp == 16
    assert "Expert parallelism ep=8" in result.chosen.reason
    knob = search(profile, cluster, 16, fix={"ep": 4})  # a knob: every plan has ep = 4
    assert {p.strategy.ep for p in knob.candidates} == {4}
    with pytest.raises(PlannerError, match="ep=2 needs a mixture-of-experts layer; the "
                                           "model 'chain' has none"):
        search(chain_profile(), make_cluster(), 8, fix={"ep": 2})
    with pytest.raises(PlannerError, match="ep=8 does not divide dp=4"):
        search(profile, cluster, 16, fix={"dp": 4, "ep": 8})
    with pytest.raises(PlannerError, match="ep=32 does not divide the 16 experts"):
        search(profile, cluster, 32, fix={"dp": 32, "ep": 32})
    with pytest.raises(PlannerError, match="fix ep=0"):
        search(profile, cluster, 16, fix={"ep": 0})


def test_validate_checks_ep_against_dp_and_the_experts():
    profile = moe_gpt_profile(2, 256, 4, experts=16, ffn=512, seq=128)
    plan = search(profile, parse_cluster("2x8xA100-80GB"), 16, fix={"dp": 16, "ep": 8}).chosen
    validate_plan(plan, profile)
    bad = replace(plan, strategy=replace(plan.strategy, ep=3))
    with pytest.raises(SolverError, match="ep = 3 with dp = 16"):
        validate_plan(bad, profile, error_type=SolverError)
    dense = replace(plan, strategy=replace(plan.strategy, ep=1))
    validate_plan(dense, profile)
    # the same weights counted as 12 experts (one layer): 8 does not divide them
    other = replace(profile, layers=tuple(replace(l, moe_experts=12) if l.name == "moe_1"
                                          else l for l in profile.layers))
    with pytest.raises(SolverError, match="does not divide the 12 experts of layer 'moe_1'"):
        validate_plan(plan, other, error_type=SolverError)


def test_plan_json_round_trip_with_ep():
    profile = moe_gpt_profile(2, 256, 4, experts=16, ffn=512, seq=128)
    plan = search(profile, parse_cluster("2x8xA100-80GB"), 16, fix={"dp": 16, "ep": 8}).chosen
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["strategy"]["ep"] == 8 and doc["predicted"]["all_to_all_s"] > 0
    back = Plan.from_dict(doc)
    assert back == plan
    old = json.loads(json.dumps(doc))  # a plan file from before expert parallelism
    del old["strategy"]["ep"], old["predicted"]["all_to_all_s"]
    older = Plan.from_dict(old)
    assert older.strategy.ep == 1 and older.predicted.all_to_all_s == 0.0
    doc["strategy"]["ep"] = 3
    with pytest.raises(SchemaError, match="ep must divide dp"):
        Plan.from_dict(doc)


@pytest.mark.slow
def test_switch_sized_model_plans_quickly():
    """A 1.6e12-parameter Switch-like model (15 MoE layers of 2048 experts, h 4096) on 1024
    H100s: the time is printed, not asserted (benchmark-style)."""
    profile = moe_gpt_profile(15, 4096, 32, experts=2048, ffn=6400, seq=2048)
    assert sum(l.params for l in profile.layers) == pytest.approx(1.6e12, rel=0.02)
    start = time.perf_counter()
    result = search(profile, parse_cluster("128x8xH100-80GB"), 1024)
    print(f"\n1.6T MoE on 1024 H100: {time.perf_counter() - start:.1f} s, "
          f"{result.evaluated} strategies; chose {result.chosen.name}")
    assert result.chosen.predicted.fits and result.chosen.strategy.ep > 1


def test_nothing_fits_names_expert_parallelism_for_a_moe_layer():
    from tfplan.core.errors import InfeasiblePlanError
    profile = _tiny_moe()
    moe = next(l for l in profile.layers if l.is_moe)
    cluster = _big_cluster(nodes=1, memory_bytes=moe.state_bytes // 8)
    with pytest.raises(InfeasiblePlanError, match="in its 8 experts: expert parallelism "
                                                  "divides that part by ep"):
        search(profile, cluster, 8)


def test_cli_fix_accepts_ep():
    from tfplan.cli import parse_fix
    assert parse_fix("dp=16,ep=8") == {"dp": 16, "ep": 8}
    with pytest.raises(PlannerError, match="ep=N with N >= 1"):
        parse_fix("ep=0")
    with pytest.raises(PlannerError, match="gives ep twice"):
        parse_fix("ep=2,ep=4")


def test_plans_without_expert_parallelism_write_no_ep():
    plan = search(chain_profile(), make_cluster(), 32).chosen
    doc = plan.to_dict()
    assert "ep" not in doc["strategy"] and "all_to_all_s" not in doc["predicted"]
    assert Plan.from_dict(json.loads(json.dumps(doc))) == plan


def test_full_recomputation_repeats_the_forward_all_to_alls():
    p = _tiny_moe()
    pricer = Pricer(search_context(p, _big_cluster(), 8))
    plain, full = (pricer.estimate(Choice(dp=8, tp=1, pp=1, microbatch_size=1,
                                          num_microbatches=1, recompute=rc, ep=8))
                   for rc in ("none", "full"))
    forward_only = pricer.devices(1, 1, 1, "full", 1, 8, ep=8)["recompute"][0]
    assert full.breakdown.recompute_s == pytest.approx(forward_only + full.all_to_all_s / 2)
    assert plain.breakdown.recompute_s == 0.0 and full.all_to_all_s == plain.all_to_all_s
