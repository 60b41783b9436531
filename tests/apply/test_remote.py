"""Plans whose replicas span two local worker processes (``apply.remote``).

``plan launch --workers 2`` starts this file as a script on two workers (TF_CONFIG on
127.0.0.1, 2 logical CPUs each). Worker 1's ``apply.ensure_devices`` serves its devices
and exits 0 when worker 0 is done; worker 0 connects to both, wraps the tiny models with
hand-made plans over ``/job:worker/task:{0,1}/device:CPU:{0,1}`` whose replicas span
the workers, and trains them; the test process trains the same models on one device.
Losses of 10 ``train_on_batch`` steps must agree within 1e-4 (relative), and every
variable and optimizer slot must sit on the device the plan names.

The one shape left here: the MLP as dp2 x pp2 in the Megatron layout (stage s on worker s,
the two replicas on its two CPUs, 1F1B) with ZeRO-1 (one copy of the optimizer state in
all), with ``fit``/``evaluate``/``predict``/``save_weights``/``load_weights``. Every other
plan across workers (pipelines, tensor ranks, general placements across them) runs one
program per worker on the SPMD engine: tests/apply/test_workers.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

if __name__ == "__main__":  # a worker: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

from tests.apply.helpers import base_model, make_plan  # noqa: E402
from tests.apply.test_workers import (SCHEDULE, SPLITS, dev,  # noqa: E402
                                      launch_with_references, train_cases)

WORKERS, CPUS = 2, 2
STEPS = 10
GLOBAL_BATCH = 16
# ZeRO where a replica's stages lie on both workers: the one shape worker 0 still drives
# (every other plan across workers runs one program per worker: tests/apply/test_workers)
CASES = [("tiny_mlp", "dp2xpp2+zero1")]
SLOW_CASES: list = []
DEFAULT_CASES = CASES
MODE = {"pp2": "pipeline", "tp2": "tensor_parallel", "dp2xpp2": "tensor_parallel",
        "dp2xpp2+zero1": "tensor_parallel", "placement": "placement"}
BRANCHY = {dev(0, 0): ("stem", "branch_1", "head"), dev(1, 1): ("branch_0", "merge")}


def remote_plan(model, name: str, kind: str):
    """A plan for ``2xcpu:2`` whose replicas span the two workers."""
    if kind == "pp2":  # stage s on worker s
        plan = make_plan(model, [[dev(0, 0)], [dev(1, 0)]], num_microbatches=2,
                         global_batch=GLOBAL_BATCH)
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(
            plan.strategy, schedule=SCHEDULE[name]))
    elif kind == "tp2":  # tensor rank t on worker t
        plan = make_plan(model, [[dev(0, 0), dev(1, 0)]], global_batch=GLOBAL_BATCH)
        strategy = dataclasses.replace(plan.strategy, dp=1, tp=2, microbatch_size=GLOBAL_BATCH)
        plan = dataclasses.replace(plan, strategy=strategy, tp_splits=SPLITS[name])
    elif kind.startswith("dp2xpp2"):  # Megatron layout: stage s on worker s, replica r
        plan = make_plan(model, [[dev(s, 0), dev(s, 1)] for s in range(WORKERS)],  # on CPU r
                         num_microbatches=2, global_batch=GLOBAL_BATCH)
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(
            plan.strategy, schedule="1f1b", zero_stage=int(kind.endswith("zero1"))))
    else:  # a general placement, one branch per worker
        plan = make_plan(model, [[d] for d in BRANCHY], global_batch=GLOBAL_BATCH,
                         stage_layers=list(BRANCHY.values()))
        plan = dataclasses.replace(plan, placement="general")
    one = plan.cluster
    cluster = dataclasses.replace(one, name=f"{WORKERS}xcpu:{CPUS}", num_nodes=WORKERS,
                                  devices_per_node=CPUS, inter_node_link=one.intra_node_link)
    return dataclasses.replace(plan, cluster=cluster, name=f"{name} {kind} across workers")


def worker_main(out_dir: str) -> None:
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(os.path.join(out_dir, "cases.json"), encoding="utf-8") as f:
        cases = [tuple(case) for case in json.load(f)]
    plans = [load_plan(os.path.join(out_dir, f"plan{i}.json")) for i in range(len(cases))]
    apply.ensure_devices(plans[0])  # worker 1 serves its devices and exits here
    assert task == 0, "only worker 0 gets past ensure_devices"
    train_cases(out_dir, cases, plans)


def test_plans_across_workers_train_like_one_device(tmp_path):
    run_cases_across_workers(tmp_path, DEFAULT_CASES)


def run_cases_across_workers(tmp_path, cases: list) -> None:
    """Launch ``cases`` (worker 0 drives both workers' devices); losses and what
    ``scenario`` runs equal one device's, every variable on its planned device."""
    import numpy as np

    from tfplan.apply.mode import execution_mode
    from tfplan.planner.plan import save_plan

    for i, (name, kind) in enumerate(cases):  # the workers read them
        plan = remote_plan(base_model(name)[1], name, kind)
        mode = execution_mode(plan)
        assert mode.remote and mode.mode == MODE[kind], (name, kind)
        save_plan(plan, tmp_path / f"plan{i}.json")
    (tmp_path / "cases.json").write_text(json.dumps(cases), encoding="utf-8")
    returncode, logs, references = launch_with_references(__file__, tmp_path, cases)
    assert returncode == 0, logs[-6000:]
    assert "worker (1) serves its devices" in logs, logs[-6000:]
    assert not (tmp_path / "worker1.json").exists()  # worker 1 ran no training
    with open(tmp_path / "worker0.json", encoding="utf-8") as f:
        doc = json.load(f)
    for case, reference in references.items():
        result = doc["results"][case]
        for key in reference:
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{case}: {key}")
        name, kind = case.split()
        _check_devices(result["devices"], remote_plan(base_model(name)[1], name, kind))
    assert (tmp_path / "model.weights.h5").is_file()
    # ZeRO-1: Adam's two slots (non-scalar variables) for one copy of the MLP's weights
    # where dp=2 holds two copies of each
    zero = doc["results"]["tiny_mlp dp2xpp2+zero1"]
    assert zero["slots"] == zero["weights"] > 0


def _check_devices(devices: dict, plan) -> None:
    """Every variable and optimizer slot sits on the plan's devices; a stage's layers on
    that stage's devices, on both workers."""
    for path, where in devices.items():
        assert where and set(where) <= set(plan.devices), (path, where)
    used = {d for where in devices.values() for d in where}
    assert {d.split("/device")[0] for d in used} == {"/job:worker/task:0",
                                                     "/job:worker/task:1"}, used
    for stage in plan.stages:
        for layer in stage.layers:
            for path, where in devices.items():
                if path.startswith(layer + "/") or f"/{layer}_" in path:
                    assert set(where) <= set(stage.devices), (path, where, stage.devices)


def test_worker_0_names_a_worker_that_does_not_come_up(monkeypatch, capsys):
    """No process serves worker 1's address: worker 0 says what it waits for, then
    fails with an error naming that worker (timeouts shortened for the test)."""
    import socket

    import pytest

    from tfplan import apply
    from tfplan.apply import remote
    from tfplan.core.errors import PlannerError

    ports = []
    for _ in range(2):  # two free ports on 127.0.0.1, nothing listening after
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    workers = [f"127.0.0.1:{p}" for p in ports]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": workers},
                                                "task": {"type": "worker", "index": 0}}))
    monkeypatch.setattr(remote, "CONNECT_TIMEOUT_S", 1.2)
    monkeypatch.setattr(remote, "NOTICE_INTERVAL_S", 0.5)
    plan = remote_plan(base_model("tiny_mlp")[1], "tiny_mlp", "dp2xpp2+zero1")
    with pytest.raises(PlannerError, match=f"Worker 1 \\(127.0.0.1:{ports[1]}\\) did not "
                                           "start serving its devices within 1 s"):
        apply.ensure_devices(plan)
    assert f"still waiting for worker 1 (127.0.0.1:{ports[1]})" in capsys.readouterr().err


def test_plan_mode_and_auto_for_replicas_across_workers():
    """A replica across workers runs through apply.remote (the one-host modes), and
    apply.auto does not pick such a plan without PLAN_FILE (it must be set up before
    TensorFlow starts)."""
    from tfplan.apply.auto import not_runnable_reason
    from tfplan.apply.mode import Processes, columns_span_workers, execution_mode
    from tests.apply.test_workers import worker_plan

    _, model = base_model("tiny_mlp")
    inside = worker_plan(model, "tiny_mlp", "dp2xpp2")  # each replica on one worker
    assert not columns_span_workers(inside)
    assert execution_mode(inside).processes is Processes.PER_WORKER
    assert execution_mode(inside).mode == "tensor_parallel"
    assert not columns_span_workers(remote_plan(model, "tiny_mlp", "tp2"))  # apply.spmd
    staged = remote_plan(model, "tiny_mlp", "pp2")  # one program per worker (apply.spmd)
    assert columns_span_workers(staged)
    assert execution_mode(staged).processes is Processes.PER_WORKER
    assert not_runnable_reason(staged) is None
    across = remote_plan(model, "tiny_mlp", "dp2xpp2+zero1")  # ZeRO there: worker 0
    assert columns_span_workers(across) and execution_mode(across).remote
    assert execution_mode(across).mode == "tensor_parallel"
    assert "PLAN_FILE" in not_runnable_reason(across)
    assert not_runnable_reason(inside) is None


if __name__ == "__main__":
    worker_main(sys.argv[1])
