"""planner.pipeline_ilp: every splitter answers the same problem, and agrees with brute force."""
from __future__ import annotations

import random

import pytest

from tfplan.core.errors import InfeasiblePlanError, SolverError
from tfplan.planner.pipeline_ilp import (SplitProblem, Transfer, best_split, brute_force_split,
                                  check_split, dp_split, evaluate_split, ilp_split,
                                  min_max_stage_memory, min_stages_to_fit)

SOLVERS = {
    "ilp": lambda p: ilp_split(p, time_limit_s=10.0),
    "dp": dp_split,
    "best": lambda p: best_split(p, time_limit_s=10.0),
}


def random_problem(seed: int, dag: bool, memory_limited: bool) -> SplitProblem:
    """A random chain or DAG of 3..8 layers into 2..4 stages, random times, bytes, links."""
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    s_count = rng.randint(2, min(4, n))
    times = tuple(rng.uniform(0.1, 10.0) for _ in range(n))
    memories = tuple(rng.uniform(1.0, 100.0) for _ in range(n))
    readers: dict[int, set[int]] = {i: {i + 1} for i in range(n - 1)}
    if dag:  # skip connections (residuals, concatenations)
        for _ in range(rng.randint(1, n)):
            u = rng.randrange(0, n - 1)
            readers[u].add(rng.randrange(u + 1, n))
    per_byte = [rng.uniform(0.5, 2.0) for _ in range(s_count - 1)]  # per-boundary link speed
    transfers = []
    for u, dsts in sorted(readers.items()):
        nbytes = rng.uniform(0.0, 3.0)
        transfers.append(Transfer(src=u, dsts=tuple(sorted(dsts)),
                                  send_time_s=tuple(0.05 + nbytes * k for k in per_byte),
                                  recv_memory_bytes=nbytes * 10))
    cap = None
    if memory_limited:  # between the largest layer and an even share: some splits fail
        lo, hi = max(memories), sum(memories) / s_count * 1.6
        cap = round(rng.uniform(lo * 0.9, max(hi, lo * 1.2)))
    return SplitProblem(layer_names=tuple(f"l{i}" for i in range(n)), layer_time_s=times,
                        layer_memory_bytes=memories, transfers=tuple(transfers),
                        num_stages=s_count, memory_capacity_bytes=cap)


def _outcome(solver, problem):
    try:
        split = solver(problem)
    except InfeasiblePlanError:
        return None
    check_split(problem, split.stage_of_layer)  # re-check every answer
    assert split.stages == evaluate_split(problem, split.stage_of_layer)
    return split.bottleneck_s


@pytest.mark.parametrize("dag", [False, True], ids=["chain", "dag"])
@pytest.mark.parametrize("memory_limited", [False, True], ids=["ample", "limited"])
def test_optimum_equals_brute_force(dag, memory_limited):
    infeasible = 0
    for seed in range(30):
        problem = random_problem(1000 * dag + 100 * memory_limited + seed, dag, memory_limited)
        want = _outcome(brute_force_split, problem)
        infeasible += want is None
        for name, solver in SOLVERS.items():
            got = _outcome(solver, problem)
            if want is None:
                assert got is None, (name, seed)
            else:
                assert got == pytest.approx(want, rel=1e-6), (name, seed, problem)
    if memory_limited:  # the limits really do cut splits away, without ruling out everything
        assert 0 < infeasible < 30


def test_relayed_tensor_is_paid_at_every_boundary_and_held_by_every_stage_it_enters():
    p = SplitProblem(layer_names=("a", "b", "c"), layer_time_s=(1.0, 1.0, 1.0),
                     layer_memory_bytes=(10.0, 10.0, 10.0),
                     transfers=(Transfer(0, (1, 2), (0.5, 0.25), 4.0),
                                Transfer(1, (2,), (0.1, 0.2), 1.0)),
                     num_stages=3)
    a, b, c = evaluate_split(p, (0, 1, 2))
    assert (a.send_s, b.send_s, c.send_s) == (0.5, 0.25 + 0.2, 0.0)
    assert (a.memory_bytes, b.memory_bytes, c.memory_bytes) == (10, 14, 15)
    # a tensor read by two layers of a later stage crosses once
    two = SplitProblem(layer_names=("a", "b", "c"), layer_time_s=(1.0, 1.0, 1.0),
                       layer_memory_bytes=(1.0, 1.0, 1.0),
                       transfers=(Transfer(0, (1, 2), (0.5,), 4.0),), num_stages=2)
    assert evaluate_split(two, (0, 1, 1))[0].send_s == 0.5


def test_same_input_same_split():
    problem = random_problem(7, dag=True, memory_limited=False)
    assert ilp_split(problem) == ilp_split(problem)


def test_a_layer_larger_than_memory_is_named():
    p = SplitProblem(layer_names=("small", "huge", "tiny"), layer_time_s=(1.0, 1.0, 1.0),
                     layer_memory_bytes=(10.0, 3 * 2**30, 1.0), transfers=(), num_stages=2,
                     memory_capacity_bytes=2**30)
    for solver in (*SOLVERS.values(), brute_force_split):
        with pytest.raises(InfeasiblePlanError, match=r"'huge' alone needs 3.00 GiB"):
            solver(p)


def test_too_few_stages_says_how_many_would_fit():
    p = SplitProblem(layer_names=tuple("abcdef"), layer_time_s=(1.0,) * 6,
                     layer_memory_bytes=(10.0,) * 6, transfers=(), num_stages=2,
                     memory_capacity_bytes=25)
    with pytest.raises(InfeasiblePlanError, match="at least 3 stages would fit"):
        ilp_split(p)
    assert min_stages_to_fit(p) == 3
    assert min_max_stage_memory(p)[0] == 30


def test_more_stages_than_layers_is_infeasible():
    with pytest.raises(InfeasiblePlanError, match="3 layers into 4"):
        SplitProblem(layer_names=("a", "b", "c"), layer_time_s=(1.0,) * 3,
                     layer_memory_bytes=(1.0,) * 3, transfers=(), num_stages=4)


def test_check_split_rejects_broken_answers():
    p = SplitProblem(layer_names=tuple("abcd"), layer_time_s=(1.0,) * 4,
                     layer_memory_bytes=(10.0,) * 4, transfers=(), num_stages=2,
                     memory_capacity_bytes=25)
    check_split(p, (0, 0, 1, 1))
    with pytest.raises(SolverError, match="contiguous"):
        check_split(p, (0, 1, 0, 1))
    with pytest.raises(SolverError, match="every stage used"):
        check_split(p, (0, 0, 0, 0))
    with pytest.raises(SolverError, match="over the 25-byte capacity"):
        check_split(p, (0, 0, 0, 1))
    with pytest.raises(SolverError, match="placed 3 layers"):
        check_split(p, (0, 0, 1))


def test_brute_force_refuses_big_inputs():
    p = SplitProblem(layer_names=tuple(f"l{i}" for i in range(60)), layer_time_s=(1.0,) * 60,
                     layer_memory_bytes=(1.0,) * 60, transfers=(), num_stages=8)
    with pytest.raises(SolverError, match="ilp_split"):
        brute_force_split(p)


def test_bigger_problem_is_solved_to_optimality_quickly():
    n = 48
    p = SplitProblem(layer_names=tuple(f"l{i}" for i in range(n)),
                     layer_time_s=tuple(1.0 + (i % 5) * 0.1 for i in range(n)),
                     layer_memory_bytes=(1.0,) * n,
                     transfers=tuple(Transfer(i, (i + 1,), (0.01,) * 5, 0.1)
                                     for i in range(n - 1)), num_stages=6)
    split = best_split(p, time_limit_s=10)
    assert "optimal" in split.solver
    assert split.bottleneck_s == pytest.approx(dp_split(p).bottleneck_s)


def test_fractional_capacity_is_read_as_whole_bytes():
    for seed in range(20):
        problem = random_problem(5000 + seed, dag=True, memory_limited=True)
        odd = SplitProblem(**{**problem.__dict__,
                              "memory_capacity_bytes": problem.memory_capacity_bytes + 0.7})
        want = _outcome(brute_force_split, odd)
        for name, solver in SOLVERS.items():
            got = _outcome(solver, odd)
            assert (got is None) == (want is None), (name, seed)
            if want is not None:
                assert got == pytest.approx(want, rel=1e-6), (name, seed)


def test_best_split_keeps_the_dp_answer_above_the_ilp_size_limit():
    problem = random_problem(11, dag=True, memory_limited=False)
    split = best_split(problem, max_ilp_binaries=1)
    assert split.solver.startswith("dynamic programming") and "skipped above 1" in split.solver
    assert split.bottleneck_s == pytest.approx(brute_force_split(problem).bottleneck_s)
