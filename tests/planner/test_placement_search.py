"""planner.placement_search: general placement as a search candidate, on a real branchy
Keras model (tests/apply/branchy.py, profiled symbolically) and on hand-made profiles."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from tfplan.planner import cost_model as cm
from tfplan.core.cluster import LinkSpec
from tfplan.core.errors import SchemaError
from tfplan.planner.placement_ilp import MAX_LAYERS, brute_force_placement
from tfplan.planner.placement_search import critical_path, eligible, placement_plans, placement_problem
from tfplan.planner.plan import Plan, load_plan, save_plan
from tfplan.core.presets import parse_cluster
from tfplan.planner.context import search_context
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile


def _cpu(spec: str):
    """Logical CPU devices priced as if each had its own cores (as GPUs do): on this host
    they share them (``devices_per_compute_pool``), which no placement can beat."""
    import dataclasses
    return dataclasses.replace(parse_cluster(spec), devices_per_compute_pool=1)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = 8


def _profile(path: str):
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source
    return profile_source(load_model_source(os.path.join(ROOT, path)), batch_size=1)


@pytest.fixture(scope="module")
def branchy():
    return _profile("tests/apply/branchy.py")


@pytest.fixture(scope="module", params=[2, 4], ids=["cpu:2", "cpu:4"])
def searched(request, branchy):
    cluster = _cpu(f"cpu:{request.param}")
    return cluster, search(branchy, cluster, BATCH)


def _general(result):
    return [p for p in result.candidates if p.placement == "general"]


def test_branchy_model_gets_a_general_placement_equal_to_brute_force(branchy, searched):
    cluster, result = searched
    (plan,) = _general(result)
    validate_plan(plan, branchy)
    s = plan.strategy
    assert (s.dp, s.tp, s.pp, s.num_microbatches, s.microbatch_size) == (1, 1, 2, 1, BATCH)
    assert plan.name == "general placement on 2 devices" and "HiGHS" in plan.solver
    where = plan.device_of_layer()
    assert set(where) == {layer.name for layer in branchy.layers}
    assert where["branch_0"] != where["branch_1"]  # the two heavy branches overlap
    assert list(plan.devices) == list(cluster.device_names()[:2])

    problem = placement_problem(search_context(branchy, cluster, BATCH))
    assert problem.num_devices == min(cluster.num_devices, 4)
    best = brute_force_placement(problem)
    b = plan.predicted.breakdown
    makespan = b.compute_s + b.communication_s + b.bubble_s
    assert makespan == pytest.approx(best.makespan_s, rel=1e-9)
    branch_s = problem.layer_time_s[problem.layer_names.index("branch_1")]
    assert makespan < sum(problem.layer_time_s) - 0.5 * branch_s  # the branches overlap
    # the optimizer updates run on both devices at once: the slower one counts
    p = branchy
    per_device = [[p.layers[[l.name for l in p.layers].index(n)] for n in st.layers]
                  for st in plan.stages]
    assert b.optimizer_s == pytest.approx(max(cm.optimizer_time_s(
        sum(l.param_bytes for l in ls), sum(l.grad_bytes for l in ls),
        sum(l.optimizer_bytes for l in ls), cluster.device) for ls in per_device))
    assert plan.predicted.step_time_s == pytest.approx(makespan + b.optimizer_s, rel=1e-12)
    single = next(c for c in result.candidates if c.name == "single device")
    assert plan.predicted.max_memory_bytes < single.predicted.max_memory_bytes


def test_placement_wins_when_the_model_says_it_is_faster(searched):
    cluster, result = searched
    (plan,) = _general(result)
    others = [p for p in result.candidates if p.predicted.fits and p is not plan]
    if result.chosen.placement == "general":
        assert all(plan.predicted.step_time_s < p.predicted.step_time_s for p in others)
        runner = result.candidates[1]
        assert result.chosen.reason.startswith("general placement on 2 devices is predicted ")
        assert f"x faster than the runner-up {runner.name} (" in result.chosen.reason
    else:  # something is faster, and it is ranked before the placement
        assert result.chosen.predicted.step_time_s < plan.predicted.step_time_s


def test_heavy_branches_with_nothing_else_to_split_choose_the_placement():
    # batch 1: no data parallelism, no micro-batches; DepthwiseConv2D branches: no tensor split.
    # One device runs the two equal branches in turn; the placement runs them at once.
    fan = _fan_out(2, branch_flops=10**10, branch_type="DepthwiseConv2D")
    result = search(fan, _cpu("cpu:2"), 1)
    chosen, runner = result.candidates[:2]
    assert chosen.placement == "general" and chosen is result.chosen
    validate_plan(chosen, fan)
    assert chosen.device_of_layer()["b0"] != chosen.device_of_layer()["b1"]
    assert chosen.predicted.step_time_s < 0.6 * runner.predicted.step_time_s
    assert chosen.reason.startswith("general placement on 2 devices is predicted 2.0x faster")
    assert f"x faster than the runner-up {runner.name} (" in chosen.reason
    # the same layers in a chain: nothing can overlap, no placement is offered
    chain = _fan_out(2, branch_flops=10**10, branch_type="DepthwiseConv2D", chain=True)
    assert not _general(search(chain, _cpu("cpu:2"), 1))


def test_critical_path_sums_to_the_makespan(branchy):
    problem = placement_problem(search_context(branchy, _cpu("cpu:2"), BATCH))
    best = brute_force_placement(problem)
    compute_s, transfer_s, idle_s = critical_path(problem, best)
    assert compute_s + transfer_s + idle_s == pytest.approx(best.makespan_s, rel=1e-12)
    assert transfer_s > 0 and idle_s == pytest.approx(0.0, abs=1e-15)
    assert compute_s < sum(problem.layer_time_s)  # one branch is off the path


def test_slow_link_offers_no_placement(branchy):
    cpu2 = _cpu("cpu:2")
    slow = replace(cpu2, intra_node_link=LinkSpec(bandwidth_bytes_per_s=1e3, latency_s=1.0),
                   intra_node_p2p_link=None)
    ctx = search_context(branchy, slow, BATCH)
    assert eligible(ctx)
    assert placement_plans(ctx, 10.0) == []  # every split costs more than a branch saves


def test_chain_model_offers_no_placement():
    mlp = _profile("examples/mlp.py")
    cluster = _cpu("cpu:2")
    assert not eligible(search_context(mlp, cluster, BATCH))
    assert not _general(search(mlp, cluster, BATCH))


def _fan_out(n_branches: int, branch_flops: int = 10**6, branch_type: str = "Dense",
             chain: bool = False, branch_params: int = 100) -> ModelProfile:
    """Hand-made: d0 feeding n_branches independent layers b0.. (or, with ``chain``, the
    same layers one after another), Adam; numbers for one sample."""
    names = ["d0"] + [f"b{i}" for i in range(n_branches)]
    feeds = {n: ("input_1" if i == 0 else names[i - 1] if chain else "d0")
             for i, n in enumerate(names)}
    params = {n: 100 if n == "d0" else branch_params for n in names}
    layers = tuple(LayerProfile(
        name=n, type="Dense" if n == "d0" else branch_type, params=params[n],
        trainable_params=params[n], param_bytes=4 * params[n], grad_bytes=4 * params[n],
        optimizer_bytes=8 * params[n], activation_bytes=64,
        flops_fwd=10**6 if n == "d0" else branch_flops,
        flops_bwd=2 * (10**6 if n == "d0" else branch_flops), inputs=(feeds[n],))
        for n in names)
    edges = tuple(Edge(feeds[n], n, 64) for n in names)
    return ModelProfile(model_name="fan", batch_size=1, precision="float32", optimizer="adam",
                        optimizer_slots_per_param=2, layers=layers, edges=edges)


def test_eligibility_limits():
    cpu2 = _cpu("cpu:2")
    assert eligible(search_context(_fan_out(MAX_LAYERS - 1), cpu2, BATCH))  # 12 layers
    assert not eligible(search_context(_fan_out(MAX_LAYERS), cpu2, BATCH))  # 13 layers
    assert not eligible(search_context(_fan_out(3), _cpu("cpu:1"), BATCH))
    two_nodes = replace(cpu2, num_nodes=2, inter_node_link=cpu2.intra_node_link)
    assert not eligible(search_context(_fan_out(3), two_nodes, BATCH))


def test_placement_plan_round_trips(searched, tmp_path):
    _, result = searched
    (plan,) = _general(result)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert json.loads(path.read_text())["placement"] == "general"
    assert load_plan(path) == plan
    doc = plan.to_dict()
    del doc["placement"]  # a plan.json from before general placements
    assert Plan.from_dict(doc).placement == "stages"
    doc["placement"] = "anywhere"
    with pytest.raises(SchemaError, match="Plan.placement is 'anywhere'"):
        Plan.from_dict(doc)


def test_search_keeps_stdout_clean(branchy, capfd):
    # this problem makes HiGHS print a diagnostic from C; `plan analyze --json` owns stdout
    search(branchy, _cpu("cpu:2"), BATCH)
    assert capfd.readouterr().out == ""


def test_five_tiny_branches_spread_over_four_devices():
    # tiny layers on 6 GB devices: the memory rows cannot bind and are left out of the
    # MILP (coefficients near 1e-7 made HiGHS stop with "Solve error" on 7 such branches)
    fan = _fan_out(5, branch_flops=10**9)
    ctx = search_context(fan, _cpu("cpu:4"), BATCH)
    (plan,) = placement_plans(ctx, 10.0)
    validate_plan(plan, fan)
    problem = placement_problem(ctx)
    assert sum(problem.layer_memory_bytes) < problem.memory_capacity_bytes
    assert "optimal" in plan.solver and plan.strategy.pp == 4  # 5 branches, 4 devices
    b = plan.predicted.breakdown
    assert b.compute_s + b.communication_s + b.bubble_s == pytest.approx(
        brute_force_placement(problem).makespan_s, rel=1e-9)


def _with_memory(cluster, memory_bytes: int):
    return replace(cluster, device=replace(cluster.device, memory_bytes=memory_bytes))


def test_tight_memory_the_placement_fits_where_one_device_does_not():
    # two branches of 160 MB of state each (weights, gradients, Adam) on 250 MB devices
    fan = _fan_out(2, branch_flops=10**9, branch_type="Conv2D", branch_params=10**7)
    result = search(fan, _with_memory(_cpu("cpu:2"), 250 * 10**6), 1)
    (plan,) = _general(result)
    assert plan.predicted.fits and plan.predicted.max_memory_bytes <= 250 * 10**6
    assert plan.device_of_layer()["b0"] != plan.device_of_layer()["b1"]
    single = next(p for p in result.candidates if p.name == "single device")
    assert not single.predicted.fits
    assert result.chosen is plan


def test_impossible_memory_shows_the_fastest_placement_as_not_fitting():
    fan = _fan_out(2, branch_flops=10**9, branch_type="Conv2D", branch_params=10**7)
    ctx = search_context(fan, _with_memory(_cpu("cpu:2"), 100 * 10**6), 1)
    (plan,) = placement_plans(ctx, 10.0)  # one branch alone needs 176 MB with the margin
    assert not plan.predicted.fits and "no placement fits memory" in plan.solver
    validate_plan(plan, fan)


def test_devices_sharing_cores_gain_nothing_from_a_placement():
    # cpu:N as it is: the logical devices share the host's cores, so the placement's
    # step lasts at least all its layers' time added up -- never faster than one device
    from tfplan.planner.search import search
    result = search(_fan_out(3), parse_cluster("cpu:2"), 1)
    single = next(p for p in result.candidates if p.name == "single device")
    for plan in result.candidates:
        if plan.placement == "general":
            assert plan.predicted.step_time_s >= single.predicted.step_time_s * (1 - 1e-9)
