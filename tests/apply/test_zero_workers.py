"""ZeRO-2 across two local worker processes (``apply.zero_workers``, through
``apply.multi_worker_hybrid``).

``plan launch --workers 2`` starts this file as a script on two workers (TF_CONFIG on
127.0.0.1, 2 logical CPUs each), as tests/apply/test_multi_worker_hybrid.py does; each
worker wraps the tiny models with hand-made ``2xcpu:2`` plans with ``zero_stage=2`` and
two micro-batches, and the test process trains the same models on one device. Losses
of 10 ``train_on_batch`` steps agree within 1e-4 (relative); every variable and slot
sits on one of the plan's devices of that worker, and the workers' optimizer slots add
up to one copy of the state.

Cases: the transformer's dp2 x tp2 (Megatron splits over each worker's 2 CPUs; it also
runs ``fit``, ``evaluate``, ``predict`` and weight files) and the MLP's dp4 (two local
replicas per worker, whose gradients are summed on the worker before the all-reduce).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

if __name__ == "__main__":  # a worker: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

from tests.apply.helpers import base_model  # noqa: E402
from tests.apply.test_multi_worker_hybrid import (GLOBAL_BATCH, WORKERS,  # noqa: E402
                                                  _check_devices, launch_with_references,
                                                  train_cases, worker_plan)

CASES = [("tiny_transformer", "dp2xtp2+zero2"), ("tiny_mlp", "dp4+zero2")]
MICROBATCHES = 2


def zero2_plan(model, name: str, kind: str):
    """``worker_plan``'s plan for the kind, with ZeRO-2 and two micro-batches."""
    plan = worker_plan(model, name, kind.removesuffix("+zero2"))
    s = plan.strategy
    strategy = dataclasses.replace(s, zero_stage=2, num_microbatches=MICROBATCHES,
                                   microbatch_size=GLOBAL_BATCH // (s.dp * MICROBATCHES))
    return dataclasses.replace(plan, strategy=strategy, name=plan.name + " zero2 m2")


def worker_main(out_dir: str) -> None:
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    plans = [load_plan(os.path.join(out_dir, f"plan{i}.json")) for i in range(len(CASES))]
    apply.ensure_devices(plans[0])  # the strategy and 2 logical CPUs, before any TF op
    train_cases(out_dir, CASES, plans)


def test_zero2_over_two_workers_trains_like_one_device(tmp_path):
    import numpy as np

    from tfplan.apply.dimensions import unapplied
    from tfplan.apply.mode import execution_mode
    from tfplan.planner.plan import save_plan

    plans = {}
    for i, (name, kind) in enumerate(CASES):  # the workers read them
        plan = plans[(name, kind)] = zero2_plan(base_model(name)[1], name, kind)
        mode = execution_mode(plan)
        assert mode.mode == "multi_worker_hybrid" and unapplied(plan, mode) == []
        save_plan(plan, tmp_path / f"plan{i}.json")
    returncode, logs, references = launch_with_references(__file__, tmp_path, CASES)
    assert returncode == 0, logs[-6000:]
    docs = []
    for task in range(WORKERS):
        with open(tmp_path / f"worker{task}.json", encoding="utf-8") as f:
            doc = json.load(f)
        docs.append(doc)
        assert doc["task"] == task
        for case, reference in references.items():
            result = doc["results"][case]
            assert result["mode"] == "MultiWorkerHybridModel", case
            for key in reference:
                np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-6,
                                           err_msg=f"{case}: {key}")
            name, kind = case.split()
            _check_devices(result["devices"], plans[(name, kind)], task)
    assert (tmp_path / "model.weights.h5").is_file()  # written once, by the chief
    # one copy of the optimizer state over the job, each worker holding part of it
    for (name, kind), local_dp in zip(CASES, (1, 2)):
        held = [doc["results"][f"{name} {kind}"]["slots"] for doc in docs]
        weights = docs[0]["results"][f"{name} {kind}"]["weights"] // local_dp
        assert sum(held) == 2 * weights and all(0 < h < 2 * weights for h in held), (
            name, kind, held)  # Adam: 2 slots per weight


if __name__ == "__main__":
    worker_main(sys.argv[1])
