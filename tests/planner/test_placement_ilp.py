"""planner.placement_ilp: the placement MILP agrees with brute force; branches overlap."""
from __future__ import annotations

import os
import random

import pytest

from tfplan.core.errors import InfeasiblePlanError, SolverError
from tfplan.planner.placement_ilp import (MAX_LAYERS, PlacementEdge, PlacementProblem,
                                   brute_force_placement, check_placement, ilp_placement)


def random_problem(seed: int, dag: bool, memory_limited: bool) -> PlacementProblem:
    """A random chain or DAG of 3..6 layers on 2..3 devices, random times, transfers, bytes."""
    rng = random.Random(seed)
    n, devices = rng.randint(3, 6), rng.randint(2, 3)
    pairs = {(i, i + 1) for i in range(n - 1)}
    if dag:  # branches: drop some chain links, add skip and fan-out edges
        pairs = {p for p in pairs if rng.random() < 0.6}
        for _ in range(rng.randint(1, n)):
            u = rng.randrange(0, n - 1)
            pairs.add((u, rng.randrange(u + 1, n)))
    memories = tuple(rng.uniform(1.0, 100.0) for _ in range(n))
    cap = None
    if memory_limited:  # between the largest layer and an even share: some placements fail
        cap = rng.uniform(max(memories) * 0.95, sum(memories) / devices * 1.8)
    return PlacementProblem(
        layer_names=tuple(f"l{i}" for i in range(n)),
        layer_time_s=tuple(rng.uniform(0.1, 10.0) for _ in range(n)),
        layer_memory_bytes=memories,
        edges=tuple(PlacementEdge(f"l{u}", f"l{v}", rng.uniform(0.0, 4.0))
                    for u, v in sorted(pairs)),
        num_devices=devices, memory_capacity_bytes=cap)


def _outcome(solver, problem):
    try:
        placement = solver(problem)
    except InfeasiblePlanError:
        return None
    check_placement(problem, placement.device_of_layer, placement.start_s)  # re-check
    return placement.makespan_s


@pytest.mark.parametrize("dag", [False, True], ids=["chain", "dag"])
@pytest.mark.parametrize("memory_limited", [False, True], ids=["ample", "limited"])
def test_optimum_equals_brute_force(dag, memory_limited):
    outcomes = []
    for seed in range(15):
        problem = random_problem(1000 * dag + 100 * memory_limited + seed, dag, memory_limited)
        want, got = _outcome(brute_force_placement, problem), _outcome(ilp_placement, problem)
        outcomes.append(want)
        if want is None:
            assert got is None, f"seed {seed}: MILP found a placement brute force says cannot exist"
        else:
            assert got == pytest.approx(want, rel=1e-9), f"seed {seed}"
    if memory_limited:
        assert any(o is None for o in outcomes) and any(o is not None for o in outcomes)


def _diamond(transfer_s: float, cap: float | None = None) -> PlacementProblem:
    #        a (1 s)
    #       /       \
    #   b (10 s)   c (10 s)
    #       \       /
    #        d (1 s)
    return PlacementProblem(
        layer_names=("a", "b", "c", "d"), layer_time_s=(1.0, 10.0, 10.0, 1.0),
        layer_memory_bytes=(10.0, 40.0, 40.0, 10.0),
        edges=(PlacementEdge("a", "b", transfer_s), PlacementEdge("a", "c", transfer_s),
               PlacementEdge("b", "d", transfer_s), PlacementEdge("c", "d", transfer_s)),
        num_devices=2, memory_capacity_bytes=cap)


def test_diamond_on_two_devices_overlaps_its_branches():
    problem = _diamond(transfer_s=0.5)
    placement = ilp_placement(problem)
    dev, start, finish = placement.device_of_layer, placement.start_s, placement.finish_s
    assert dev[1] != dev[2]  # the branches on different devices ...
    assert min(finish[1], finish[2]) > max(start[1], start[2])  # ... at the same time
    # a and b on one device, c and d on the other: c starts after a's transfer (1 + 0.5),
    # ends at 11.5, when b's output (11 + 0.5) reaches d: 11.5 + 1 = 12.5 < 22 in series.
    assert placement.makespan_s == pytest.approx(12.5, rel=1e-12)
    assert placement.makespan_s < sum(problem.layer_time_s)
    assert brute_force_placement(problem).makespan_s == pytest.approx(12.5, rel=1e-12)


def test_slow_link_keeps_the_diamond_on_one_device_unless_memory_binds():
    assert ilp_placement(_diamond(transfer_s=20.0)).makespan_s == pytest.approx(22.0)
    tight = _diamond(transfer_s=20.0, cap=60.0)  # 100 bytes in all: must spread
    placement = ilp_placement(tight)
    assert max(placement.memory_bytes_per_device) <= 60.0
    assert placement.makespan_s == pytest.approx(brute_force_placement(tight).makespan_s,
                                                 rel=1e-9)
    assert placement.makespan_s > 22.0


def test_infeasible_memory_says_what_binds():
    with pytest.raises(InfeasiblePlanError, match="'b' alone"):
        ilp_placement(_diamond(0.5, cap=30.0))
    with pytest.raises(InfeasiblePlanError, match="no way of packing"):
        brute_force_placement(_diamond(0.5, cap=45.0))  # b and c each need a device, a, d too
    with pytest.raises(InfeasiblePlanError, match="no way of packing"):
        ilp_placement(_diamond(0.5, cap=45.0))


def test_too_large_points_to_the_pipeline_ilp():
    n = MAX_LAYERS + 1
    problem = PlacementProblem(tuple(f"l{i}" for i in range(n)), (1.0,) * n, (1.0,) * n,
                               (), num_devices=2)
    with pytest.raises(SolverError, match="pipeline_ilp"):
        ilp_placement(problem)


def test_recheck_rejects_violations():
    problem = _diamond(transfer_s=0.5, cap=100.0)
    check_placement(problem, (0, 0, 1, 0), (0.0, 1.0, 1.5, 12.0))
    with pytest.raises(SolverError, match="before its input"):
        check_placement(problem, (0, 0, 1, 0), (0.0, 1.0, 1.0, 12.0))  # c ignores the transfer
    with pytest.raises(SolverError, match="same time"):
        check_placement(problem, (0, 0, 0, 0), (0.0, 1.0, 1.0, 11.0))
    with pytest.raises(SolverError, match="capacity"):
        check_placement(_diamond(0.5, cap=60.0), (0, 0, 0, 0), (0.0, 1.0, 11.0, 21.0))
    with pytest.raises(SolverError, match="device 5"):
        check_placement(problem, (0, 0, 5, 0), (0.0, 1.0, 1.5, 12.0))


def test_a_violating_solver_answer_is_caught(monkeypatch):
    # scipy issue 24141: milp can report success for a point that breaks a constraint.
    from tfplan.planner import milp

    problem = PlacementProblem(("a", "b"), (1.0, 1.0), (1.0, 1.0), (), num_devices=2)
    real = milp.Milp.solve

    def lying_solve(self, time_limit_s):
        res = real(self, time_limit_s)
        res.x[:6] = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # x[a,0] = x[b,0] = 1, S[a] = S[b] = 0
        return res

    monkeypatch.setattr(milp.Milp, "solve", lying_solve)
    with pytest.raises(SolverError, match="same time on device 0"):
        ilp_placement(problem)


def test_solver_chatter_goes_to_stderr(capfd):
    # HiGHS prints some MIP diagnostics with C printf; `plan --json` owns stdout.
    from tfplan.planner.milp import solver_chatter_to_stderr

    with solver_chatter_to_stderr():
        os.write(1, b"chatter from C\n")
    os.write(1, b"after\n")
    out, err = capfd.readouterr()
    assert "chatter from C" in err and "chatter" not in out
    assert out == "after\n"
