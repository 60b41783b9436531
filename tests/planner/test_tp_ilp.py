"""planner.tp_ilp: the intra-operator ILP agrees with brute force; Megatron's MLP pair by hand."""
from __future__ import annotations

import random

import pytest

from tfplan.core.cluster import LinkSpec
from tfplan.planner.collectives import ring_allgather_time_s as allgather_time_s
from tfplan.planner.collectives import ring_allreduce_time_s
from tfplan.core.errors import InfeasiblePlanError, SolverError
from tfplan.planner.tp_ilp import (Collective, SplitOption, TPEdge, TPLayer, TPProblem,
                            block_of_runs, brute_force_tp, check_tp, evaluate_tp, ilp_tp,
                            resharding, split_options)
from tfplan.profiler.model_profile import LayerProfile

LINK = LinkSpec(bandwidth_bytes_per_s=100.0, latency_s=0.01)
KINDS = {"dense": ("replicate", "column", "row"), "mha": ("replicate", "heads"),
         "emb": ("replicate", "vocab"), "other": ("replicate",)}


def _random_layer(rng: random.Random, name: str, degree: int) -> TPLayer:
    kind = rng.choice(list(KINDS))
    base_time, base_mem = rng.uniform(0.1, 10.0), rng.uniform(10.0, 100.0)
    options = [SplitOption("replicate", base_time, base_mem)]
    for split in KINDS[kind][1:]:
        colls = tuple(Collective("all-reduce", d, rng.uniform(0.0, 300.0))
                      for d in ("forward", "backward") if rng.random() < 0.7)
        options.append(SplitOption(split, base_time / degree * rng.uniform(0.8, 1.5),
                                   base_mem / degree * rng.uniform(0.8, 1.5), colls))
    return TPLayer(name, tuple(options))


def random_problem(seed: int, dag: bool, memory_limited: bool) -> TPProblem:
    """A random chain or DAG of 3..7 layers with 1..3 splits each, random costs and tensors."""
    rng = random.Random(seed)
    n, degree = rng.randint(3, 7), rng.choice([2, 4, 8])
    layers = tuple(_random_layer(rng, f"l{i}", degree) for i in range(n))
    pairs = {(i, i + 1) for i in range(n - 1)}
    if dag:
        for _ in range(rng.randint(1, n)):
            u = rng.randrange(0, n - 1)
            pairs.add((u, rng.randrange(u + 1, n)))
    edges = tuple(TPEdge(f"l{u}", f"l{v}", rng.uniform(0.0, 300.0)) for u, v in sorted(pairs))
    cap = None
    if memory_limited:  # between the smallest and the largest total: some choices fail
        lo = sum(min(o.memory_bytes for o in l.options) for l in layers)
        hi = sum(max(o.memory_bytes for o in l.options) for l in layers)
        cap = rng.uniform(lo * 0.6, hi)
    return TPProblem(layers, edges, degree, LINK, cap)


def _outcome(solver, problem):
    try:
        plan = solver(problem)
    except InfeasiblePlanError:
        return None
    check_tp(problem, dict(plan.split_of_layer))  # every answer re-checked
    return plan.time_s


@pytest.mark.parametrize("dag", [False, True], ids=["chain", "dag"])
@pytest.mark.parametrize("memory_limited", [False, True], ids=["ample", "limited"])
def test_optimum_equals_brute_force(dag, memory_limited):
    outcomes = []
    for seed in range(15):
        problem = random_problem(1000 * dag + 100 * memory_limited + seed, dag, memory_limited)
        want, got = _outcome(brute_force_tp, problem), _outcome(ilp_tp, problem)
        outcomes.append(want)
        if want is None:
            assert got is None, f"seed {seed}: ILP found a plan brute force says cannot exist"
        else:
            assert got == pytest.approx(want, rel=1e-9), f"seed {seed}"
    if memory_limited:
        assert any(o is None for o in outcomes) and any(o is not None for o in outcomes)


def test_shared_blocks_equal_brute_force_over_shared_choices():
    rng = random.Random(7)
    block = [_random_layer(rng, f"b{i}", 4) for i in range(3)]
    layers, block_of = [], {}
    for r in range(3):
        for i, layer in enumerate(block):
            layers.append(TPLayer(f"r{r}.{layer.name}", layer.options))
            block_of[f"r{r}.{layer.name}"] = ("block", i)
    names = [l.name for l in layers]
    edges = tuple(TPEdge(u, v, 150.0) for u, v in zip(names, names[1:]))
    for cap in (None, 0.8 * sum(max(o.memory_bytes for o in l.options) for l in layers)):
        problem = TPProblem(tuple(layers), edges, 4, LINK, cap, block_of)
        plan, want = ilp_tp(problem), brute_force_tp(problem)
        assert plan.time_s == pytest.approx(want.time_s, rel=1e-9)
        for i in range(3):  # every repeat of a block position splits alike
            assert len({plan.split(f"r{r}.b{i}") for r in range(3)}) == 1


def _blocks(count: int) -> TPProblem:
    rng = random.Random(3)
    block = [_random_layer(rng, f"b{i}", 8) for i in range(4)]
    layers = tuple(TPLayer(f"r{r}.{l.name}", l.options) for r in range(count) for l in block)
    names = [l.name for l in layers]
    return TPProblem(layers, tuple(TPEdge(u, v, 200.0) for u, v in zip(names, names[1:])), 8,
                     LINK, None, {l.name: ("blk", i % 4) for i, l in enumerate(layers)})


def test_identical_blocks_share_variables_so_the_ilp_does_not_grow():
    small, large = ilp_tp(_blocks(32)), ilp_tp(_blocks(128))
    assert small.solver.endswith("4 choice groups") and large.solver.endswith("4 choice groups")
    assert [s for _, s in large.split_of_layer[:4]] == [s for _, s in small.split_of_layer[:4]]
    assert len({s for _, s in large.split_of_layer[::4]}) == 1  # every repeat alike


def test_memory_limit_forces_a_split():
    # Splitting is slower here (collectives), so with ample memory the layer stays whole.
    options = (SplitOption("replicate", 1.0, 100.0),
               SplitOption("column", 0.5, 30.0, (Collective("all-reduce", "backward", 1000.0),)),
               SplitOption("row", 0.5, 30.0, (Collective("all-reduce", "forward", 1000.0),)))
    layers = (TPLayer("a", options), TPLayer("b", options))
    edges = (TPEdge("a", "b", 100.0),)
    ample = ilp_tp(TPProblem(layers, edges, 4, LINK, None))
    assert [s for _, s in ample.split_of_layer] == ["replicate", "replicate"]
    tight = TPProblem(layers, edges, 4, LINK, 140.0)  # one layer must split
    plan = ilp_tp(tight)
    assert sorted(s for _, s in plan.split_of_layer).count("replicate") == 1
    assert plan.memory_bytes <= 140.0
    assert plan.time_s == pytest.approx(brute_force_tp(tight).time_s, rel=1e-9)


def test_infeasible_names_the_binding_layer():
    layers = (TPLayer("big", (SplitOption("replicate", 1.0, 500.0),
                              SplitOption("column", 0.5, 200.0))),
              TPLayer("small", (SplitOption("replicate", 1.0, 10.0),)))
    problem = TPProblem(layers, (TPEdge("big", "small", 1.0),), 2, LINK, 100.0)
    for solver in (ilp_tp, brute_force_tp):
        with pytest.raises(InfeasiblePlanError, match="'big'.*column"):
            solver(problem)


def test_recheck_rejects_violations():
    problem = random_problem(5, dag=True, memory_limited=False)
    splits = {l.name: "replicate" for l in problem.layers}
    check_tp(problem, splits)
    with pytest.raises(SolverError, match="no split"):
        check_tp(problem, {})
    over = TPProblem(problem.layers, problem.edges, problem.degree, LINK, 1.0)
    with pytest.raises(SolverError, match="capacity"):
        check_tp(over, splits)
    with pytest.raises(SolverError, match="admits"):
        check_tp(problem, {**splits, "l0": "diagonal"})


def test_resharding_table():
    assert resharding("column", "row", 8.0) == ()  # the Megatron pair
    assert resharding("row", "column", 8.0) == ()  # row output is whole after its all-reduce
    assert resharding("replicate", "heads", 8.0) == ()
    assert resharding("column", "replicate", 8.0) == (Collective("all-gather", "forward", 8.0),)
    assert resharding("replicate", "row", 8.0) == (Collective("all-gather", "backward", 8.0),)
    assert resharding("column", "column", 8.0) == (Collective("all-gather", "forward", 8.0),)


def test_allgather_time_by_hand():
    # (t-1)/t * N / beta + (t-1) alpha = 3/4 * 400 / 100 + 3 * 0.01 = 3.03
    assert allgather_time_s(400.0, 4, LINK) == pytest.approx(3.03, rel=1e-12)
    assert allgather_time_s(400.0, 1, LINK) == 0.0


def _dense(name: str, units_in: int, units_out: int, batch: int) -> LayerProfile:
    params = units_in * units_out + units_out
    return LayerProfile(name=name, type="Dense", params=params, trainable_params=params,
                        param_bytes=4 * params, grad_bytes=4 * params, optimizer_bytes=8 * params,
                        activation_bytes=4 * batch * units_out,
                        flops_fwd=2 * batch * units_in * units_out,
                        flops_bwd=4 * batch * units_in * units_out,
                        input_bytes=4 * batch * units_in)


def test_megatron_mlp_pair_is_column_then_row_with_one_allreduce_each_way():
    # hidden 1024 -> 4096 -> 1024, batch 512, t = 4, fast link, compute-bound layers.
    batch, h, degree = 512, 1024, 4
    link = LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=5e-6)
    up, down = _dense("up", h, 4 * h, batch), _dense("down", 4 * h, h, batch)
    peak = 100e12

    def options(layer: LayerProfile):
        return split_options(layer, layer.input_bytes, (layer.flops_fwd + layer.flops_bwd) / peak,
                             layer.param_bytes + layer.grad_bytes + layer.optimizer_bytes,
                             layer.activation_bytes, degree)

    norm = LayerProfile(name="norm", type="LayerNormalization", params=0, trainable_params=0,
                        param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                        activation_bytes=4 * batch * h, flops_fwd=0, flops_bwd=0)
    layers = (TPLayer("norm", (SplitOption("replicate", 1e-5, norm.activation_bytes),)),
              TPLayer("up", options(up)), TPLayer("down", options(down)),
              TPLayer("out", (SplitOption("replicate", 1e-5, norm.activation_bytes),)))
    edges = (TPEdge("norm", "up", 4 * batch * h), TPEdge("up", "down", up.activation_bytes),
             TPEdge("down", "out", down.activation_bytes))
    problem = TPProblem(layers, edges, degree, link, None)
    plan = ilp_tp(problem)
    assert plan.split("up") == "column" and plan.split("down") == "row"
    kinds = sorted((c.kind, c.direction, c.where, c.nbytes) for c in plan.collectives)
    assert kinds == [("all-reduce", "backward", "up", 4 * batch * h),  # operator f: dX of up
                     ("all-reduce", "forward", "down", 4 * batch * h)]  # operator g: Y of down
    want = 2 * ring_allreduce_time_s(4 * batch * h, degree, link)
    assert plan.collective_time_s == pytest.approx(want, rel=1e-12)
    assert plan.resharding_time_s == 0.0
    assert plan.time_s == pytest.approx(brute_force_tp(problem).time_s, rel=1e-9)
    assert evaluate_tp(problem, dict(plan.split_of_layer)).time_s == plan.time_s


def test_block_of_runs_keys_positions_per_run():
    runs = [(("a0", "b0"), ("a1", "b1")), (("c0",), ("c1",))]
    assert block_of_runs(runs) == {"a0": ("run 0", 0), "b0": ("run 0", 1), "a1": ("run 0", 0),
                                   "b1": ("run 0", 1), "c0": ("run 1", 0), "c1": ("run 1", 0)}
    # every other block shares: a0, a2 alike; a1, a3 alike; never a0 with a1
    runs = [tuple((f"a{j}", f"b{j}") for j in range(5))]
    two = block_of_runs(runs, period_blocks=2)
    assert two["a0"] == two["a2"] == two["a4"] == ("run 0", 0) and two["b0"] == ("run 0", 1)
    assert two["a1"] == two["a3"] == ("run 0", 2) and two["b3"] == ("run 0", 3)
    with pytest.raises(SolverError, match="period_blocks is 0"):
        block_of_runs(runs, period_blocks=0)


def test_blocks_priced_differently_are_refused():
    a = TPLayer("a", (SplitOption("replicate", 1.0, 1.0),))
    b = TPLayer("b", (SplitOption("replicate", 2.0, 1.0),))
    problem = TPProblem((a, b), (), 2, LINK, None, {"a": ("k", 0), "b": ("k", 0)})
    with pytest.raises(SolverError, match="priced differently"):
        ilp_tp(problem)


def test_a_violating_solver_answer_is_caught(monkeypatch):
    # scipy issue 24141: milp can report success for a point that breaks a constraint.
    from tfplan.planner import milp

    layer = TPLayer("x", (SplitOption("replicate", 1.0, 100.0), SplitOption("column", 2.0, 10.0)))
    problem = TPProblem((layer,), (), 2, LINK, 50.0)
    real = milp.Milp.solve

    def lying_solve(self, time_limit_s):
        res = real(self, time_limit_s)
        res.x[:2] = [1.0, 0.0]  # s[x, replicate] = 1: 100 bytes on a 50-byte device
        return res

    monkeypatch.setattr(milp.Milp, "solve", lying_solve)
    with pytest.raises(SolverError, match="over the 50-byte capacity"):
        ilp_tp(problem)
