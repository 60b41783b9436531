"""ZeRO-2 and ZeRO-3 with replicas that span two local worker processes (``apply.remote``:
worker 0 drives every device, the one-host engines ``apply.zero`` and ``apply.zero3`` on
the plan's ``/job:worker/task:w`` devices).

``plan launch --workers 2`` starts this file as a script on two workers, as
tests/apply/test_remote.py does: worker 1 serves its 2 logical CPUs, worker 0 wraps the
tiny models with the Megatron-layout dp2 x pp2 plan (stage s on worker s, replica r on
its CPU r, two micro-batches, 1F1B) with ``zero_stage`` 3 (the transformer, also through
``fit``/``evaluate``/``predict``/weight files) and 2 (the MLP), and trains them; the
test process trains the same models on one device. Losses of 10 ``train_on_batch``
steps agree within 1e-4 (relative), and every variable and slot sits on a device of
the plan; ZeRO-3 holds one copy of each weight (as many trainable variables as one
device, where ZeRO-2 holds one per replica).
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
from tests.apply.test_workers import (launch_with_references,  # noqa: E402
                                                  train_cases)
from tests.apply.test_remote import _check_devices, remote_plan  # noqa: E402

# the first case also runs fit/evaluate/predict and weight files (train_cases)
CASES = [("tiny_transformer", "dp2xpp2+zero3"), ("tiny_mlp", "dp2xpp2+zero2")]


def zero_remote_plan(model, name: str, kind: str):
    stage = int(kind[-1])
    plan = remote_plan(model, name, "dp2xpp2")
    return dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, zero_stage=stage), name=plan.name + f" zero{stage}")


def worker_main(out_dir: str) -> None:
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    plans = [load_plan(os.path.join(out_dir, f"plan{i}.json")) for i in range(len(CASES))]
    apply.ensure_devices(plans[0])  # worker 1 serves its devices and exits here
    assert task == 0, "only worker 0 gets past ensure_devices"
    train_cases(out_dir, CASES, plans)


def test_zero2_and_zero3_across_workers_through_worker_0_train_like_one_device(tmp_path):
    import numpy as np

    from tfplan.apply.dimensions import unapplied
    from tfplan.apply.mode import execution_mode
    from tfplan.planner.plan import save_plan

    plans = {}
    for i, (name, kind) in enumerate(CASES):  # the workers read them
        plan = plans[(name, kind)] = zero_remote_plan(base_model(name)[1], name, kind)
        mode = execution_mode(plan)
        assert mode.remote and mode.mode == "tensor_parallel" and unapplied(plan, mode) == []
        save_plan(plan, tmp_path / f"plan{i}.json")
    returncode, logs, references = launch_with_references(__file__, tmp_path, CASES)
    assert returncode == 0, logs[-6000:]
    with open(tmp_path / "worker0.json", encoding="utf-8") as f:
        doc = json.load(f)
    for case, reference in references.items():
        result = doc["results"][case]
        for key in reference:
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{case}: {key}")
        name, kind = case.split()
        _check_devices(result["devices"], plans[(name, kind)])
    one_device = {name: len(base_model(name)[1].trainable_variables) for name, _ in CASES}
    zero3, zero2 = (doc["results"][f"{name} {kind}"] for name, kind in CASES)
    assert zero2["weights"] == 2 * one_device["tiny_mlp"]  # a copy per replica
    assert zero2["slots"] == 2 * one_device["tiny_mlp"]  # Adam's 2 slots, on owners only
    assert zero3["weights"] == one_device["tiny_transformer"]  # one copy in all
    assert zero3["slots"] == 2 * one_device["tiny_transformer"]


if __name__ == "__main__":
    worker_main(sys.argv[1])
