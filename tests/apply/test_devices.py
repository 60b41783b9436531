"""apply.ensure_devices: the plan's devices exist, or a typed error says which do."""
from __future__ import annotations

import dataclasses

import pytest
import tensorflow as tf

from tfplan.apply.device_names import parse_device, short_name
from tfplan.apply.devices import ensure_devices
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Stage
from tests.apply.helpers import base_model, cpus, make_plan


def _plan(devices_per_stage):
    _, mlp = base_model("tiny_mlp")
    return make_plan(mlp, devices_per_stage, cluster_size=64)


def test_existing_cpu_devices_pass():
    assert ensure_devices(_plan([cpus(0, 3, 7)])) == ("/device:CPU:0", "/device:CPU:3",
                                                       "/device:CPU:7")


def test_too_many_cpu_devices_after_runtime_start_lists_what_exists():
    with pytest.raises(PlanMismatchError) as err:
        ensure_devices(_plan([cpus(2), cpus(63)]))
    message = str(err.value)
    assert "['/device:CPU:2', '/device:CPU:63']" in message
    assert "/device:CPU:7" in message and "ensure_devices" in message


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="this host has GPUs")
def test_missing_gpus():
    with pytest.raises(PlanMismatchError, match="GPU devices"):
        ensure_devices(_plan([["/device:GPU:0", "/device:GPU:1"]]))


def test_multi_worker_names_point_to_plan_launch():
    plan = _plan([cpus(0)])
    plan = dataclasses.replace(plan, stages=(
        Stage(plan.stages[0].layers, ("/job:worker/task:1/device:GPU:0",)),))
    with pytest.raises(PlannerError, match="plan launch"):
        ensure_devices(plan)


@pytest.mark.parametrize("name", ["/device:TPU:0", "/device:CPU", "not a device"])
def test_malformed_names(name):
    with pytest.raises(PlanMismatchError, match="(?i)expected '/device:GPU:i'"):
        parse_device(name)


def test_short_name():
    assert short_name("/job:localhost/replica:0/task:0/device:CPU:3") == "/device:CPU:3"
