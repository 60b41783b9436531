"""apply.mode: how a plan runs, decided once from the plan (no devices, no TF_CONFIG);
and the apply package's import layering that keeps it at the bottom."""
from __future__ import annotations

import dataclasses
import graphlib

import pytest

from tfplan.apply.mode import Mode, Processes, execution_mode, run_processes
from tfplan.core.errors import PlannerError
from tests.apply.helpers import cpus, make_plan
from tests.test_architecture import import_graph

SIGNATURE = tuple((f"l{i}", "Dense", 10) for i in range(4))


def dev(task: int, cpu: int) -> str:
    return f"/job:worker/task:{task}/device:CPU:{cpu}"


def plan(stage_devices, *, workers: int = 1, **strategy):
    p = make_plan(None, stage_devices, signature=SIGNATURE, global_batch=16)
    placement = strategy.pop("placement", p.placement)
    p = dataclasses.replace(p, placement=placement,
                            strategy=dataclasses.replace(p.strategy, **strategy))
    if workers > 1:
        p = dataclasses.replace(p, cluster=dataclasses.replace(
            p.cluster, num_nodes=workers, inter_node_link=p.cluster.intra_node_link))
    return p


@pytest.mark.parametrize("stage_devices, strategy, expected", [
    ([cpus(0)], {}, Mode.SINGLE_DEVICE),
    ([cpus(0, 1)], {}, Mode.DATA_PARALLEL),
    ([cpus(0), cpus(1)], {}, Mode.PIPELINE),
    ([cpus(0), cpus(1)], {"placement": "general"}, Mode.PLACEMENT),
    ([cpus(0, 1), cpus(2, 3)], {}, Mode.TENSOR_PARALLEL),  # dp x pp
    ([cpus(0, 1)], {"zero_stage": 1}, Mode.TENSOR_PARALLEL),  # ZeRO-1
    ([cpus(0, 1)], {"zero_stage": 2}, Mode.TENSOR_PARALLEL),  # ZeRO-2 (apply.zero)
    ([cpus(0, 1)], {"zero_stage": 3}, Mode.TENSOR_PARALLEL),  # ZeRO-3 (apply.zero3)
    ([cpus(0, 1)], {"dp": 1, "tp": 2}, Mode.TENSOR_PARALLEL),
])
def test_one_host_plans(stage_devices, strategy, expected):
    mode = execution_mode(plan(stage_devices, **strategy))
    assert mode.mode is expected and mode.mode == expected.value
    assert mode.processes is Processes.ONE_HOST
    assert mode.worker_tasks == ()


def test_plans_over_workers():
    """One program per worker (the SPMD engine) for every plan, with the mode of its
    shape."""
    dp = execution_mode(plan([[dev(0, 0), dev(1, 0)]], workers=2))
    assert (dp.mode, dp.processes) == (Mode.DATA_PARALLEL, Processes.PER_WORKER)
    assert dp.worker_tasks == (0, 1)
    # replica r on device r: replicas 0 and 1 on worker 0, 2 and 3 on worker 1
    dp4 = execution_mode(plan([[dev(w, i) for w in range(2) for i in range(2)]], workers=2))
    assert (dp4.mode, dp4.processes) == (Mode.DATA_PARALLEL, Processes.PER_WORKER)
    zero = execution_mode(plan([[dev(0, 0), dev(1, 0)]], workers=2, zero_stage=3))
    assert (zero.mode, zero.processes) == (Mode.TENSOR_PARALLEL, Processes.PER_WORKER)
    # tensor ranks across workers: each rank a column of its own, one program per worker
    tp = execution_mode(plan([[dev(0, 0), dev(1, 0)]], workers=2, dp=1, tp=2))
    assert (tp.mode, tp.processes) == (Mode.TENSOR_PARALLEL, Processes.PER_WORKER)
    # a pipeline inside each worker, data parallel across them
    inside = plan([[dev(0, 0), dev(1, 0)], [dev(0, 1), dev(1, 1)]], workers=2)
    assert execution_mode(inside).processes is Processes.PER_WORKER
    # a column's stages across workers: one program per worker too (activations cross by
    # two-member collectives), as is a general placement across them
    pp = plan([[dev(0, 0)], [dev(1, 0)]], workers=2)
    assert (execution_mode(pp).mode, execution_mode(pp).processes) == (Mode.PIPELINE,
                                                                        Processes.PER_WORKER)
    general = plan([[dev(0, 0)], [dev(1, 0)]], workers=2, placement="general")
    assert execution_mode(general).mode is Mode.PLACEMENT
    assert execution_mode(general).processes is Processes.PER_WORKER
    # ZeRO's shards of such a column: each chunk's on its own worker
    zero_pp = plan([[dev(0, 0), dev(0, 1)], [dev(1, 0), dev(1, 1)]], workers=2, zero_stage=1)
    assert run_processes(zero_pp) is Processes.PER_WORKER


def test_a_plan_that_leaves_a_worker_idle_is_refused():
    idle = plan([[dev(0, 0), dev(1, 0)]], workers=3)
    with pytest.raises(PlannerError, match="uses 2 of its cluster's 3 workers"):
        execution_mode(idle)
    assert run_processes(idle) is Processes.PER_WORKER  # ensure_devices' question only


def _apply_imports() -> dict[str, set[str]]:
    """{apply module: apply modules it imports}, counting imports inside functions
    (the whole package graph of tests/test_architecture.py, restricted to apply)."""
    graph, _ = import_graph()
    apply = [m for m in graph if m.startswith("tfplan.apply.")]
    return {m: {t for t in graph.successors(m) if t.startswith("tfplan.apply.")}
            for m in apply}


def test_apply_modules_import_in_layers_with_mode_at_the_bottom():
    graph = _apply_imports()
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError on a cycle
    assert graph["tfplan.apply.mode"] == set()
    assert order.index("tfplan.apply.mode") < order.index("tfplan.apply.devices") \
        < order.index("tfplan.apply.wrap") < order.index("tfplan.apply.auto")
    assert [m for m, deps in graph.items() if "tfplan.apply.wrap" in deps] == [
        "tfplan.apply.auto"]  # the modes stand below wrap; only auto above it
