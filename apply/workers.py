"""A multi-worker job's workers: TF_CONFIG, and the process's MultiWorkerMirroredStrategy.

Pipeline position: below the multi-worker modes. ``apply.ensure_devices`` calls
``ensure_cluster`` for a plan that runs one program per worker
(``apply.mode.Processes.PER_WORKER``: ``/job:worker/task:w/device:CPU:i`` names, a
``Wxcpu:N`` or ``NxPRESET`` cluster with ``num_nodes`` > 1), before TensorFlow's
runtime starts (the SPMD engine's collectives across workers need the collective runtime
the strategy starts; ``get_strategy`` returns it); ``apply.auto_devices`` makes the strategy
without a plan (``ensure_strategy``). The worker processes are started with
``TF_CONFIG`` set (``plan launch --workers W SCRIPT``, ``planner.launch``).

The strategy: ``tf.distribute.MultiWorkerMirroredStrategy`` built from ``TF_CONFIG``
(collectives over gRPC; RING on CPUs, NCCL or RING on GPUs as TensorFlow chooses).
TensorFlow accepts it only before its runtime starts, so a training script calls
``apply.ensure_devices(plan)`` right after ``load_plan`` (``examples/train.py`` does),
and ``wrap`` reuses it. One strategy per process. On CPU, each worker gets the plan's
logical CPU devices first (GPUs are hidden from a CPU plan); on GPUs, the strategy takes
every local GPU (the plan's ``devices_per_node`` must equal the visible GPUs).
"""
from __future__ import annotations

import json
import os

import tensorflow as tf

from tfplan.apply.device_names import logical_cpus
from tfplan.apply.mode import plan_tasks
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan

_STRATEGY: tf.distribute.MultiWorkerMirroredStrategy | None = None


def read_tf_config() -> tuple[list[str], int]:
    """(worker addresses, this worker's index) from the TF_CONFIG environment variable."""
    text = os.environ.get("TF_CONFIG", "")
    if not text.strip():
        raise PlannerError(
            "This plan trains on several worker processes, but TF_CONFIG is not set in this "
            "process, so it does not know its cluster. Start the script with `plan launch "
            "--workers W SCRIPT ARGS...` (local processes), or set TF_CONFIG on each host "
            "(`plan launch --emit tf-config --workers W --hosts h1,h2`).")
    try:
        doc = json.loads(text)
        workers = list(doc["cluster"]["worker"])
        task = doc["task"]
        kind, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise PlannerError(
            f"TF_CONFIG is {text[:200]!r}, which is not a TensorFlow cluster description "
            f"({type(e).__name__}: {e}). Expected {{\"cluster\": {{\"worker\": [\"host:port\", "
            "...]}, \"task\": {\"type\": \"worker\", \"index\": i}}.") from None
    if kind != "worker" or not 0 <= index < len(workers):
        raise PlannerError(
            f"TF_CONFIG names task {kind!r} {index} in a cluster of {len(workers)} worker(s); "
            "expected type 'worker' and an index below the number of workers.")
    return workers, index


def check_workers(plan: Plan, tasks: dict[int, list[tuple[str, int]]],
                  workers: list[str]) -> None:
    """PlanMismatchError unless the plan uses exactly TF_CONFIG's workers."""
    if sorted(tasks) != list(range(len(workers))):
        raise PlanMismatchError(
            f"Plan {plan.name!r} is for {len(tasks)} worker(s) (tasks {sorted(tasks)}), but "
            f"TF_CONFIG describes {len(workers)}. Launch as many workers as the plan has "
            f"(plan launch --workers {len(tasks)}), or re-plan (--cluster "
            f"{len(workers)}xcpu:1).")


def ensure_cluster(plan: Plan) -> tuple[str, ...]:
    """Check the plan against TF_CONFIG and this worker's devices; make the strategy.

    Called by ``apply.ensure_devices`` for multi-worker plans: must run before
    TensorFlow's runtime starts (before any model is built). Returns the plan's devices.
    """
    global _STRATEGY
    tasks = plan_tasks(plan)
    workers, index = read_tf_config()
    check_workers(plan, tasks, workers)
    local = sorted(tasks[index])
    types = {t for devices in tasks.values() for t, _ in devices}
    if len(types) != 1:
        raise PlanMismatchError(
            f"Plan {plan.name!r} mixes device types ({tasks}); every worker trains on one "
            "type. Regenerate the plan.")
    device_type = types.pop()
    # a worker's devices: 0..need-1 of its type (a general placement may use different
    # ones on each worker; the CPUs made are as many as any worker uses)
    need = 1 + max(i for devices in tasks.values() for _, i in devices)
    if _STRATEGY is None:
        if device_type == "CPU":
            make_local_cpus(plan, need)
        _STRATEGY = _make_strategy(f"Plan {plan.name!r}", device_type)
    strategy = _STRATEGY
    if device_type == "CPU":  # made for an earlier plan: this one's must exist too
        have = len(local_cpus_now())
        if have < 1 + max(i for _, i in local):
            raise PlanMismatchError(
                f"Plan {plan.name!r} uses {need} CPU devices on each worker, but this "
                f"worker's runtime started with {have} (for an earlier plan), and no more "
                "can be added. Call apply.ensure_devices first with the plan that uses the "
                "most devices, before any TensorFlow op.")
    if device_type == "GPU":
        have = len(strategy.extended.worker_devices)
        if have < 1 + max(i for _, i in local) or not all(
                ":GPU:" in d.upper() for d in strategy.extended.worker_devices):
            raise PlanMismatchError(
                f"Plan {plan.name!r} uses GPUs up to GPU:{max(i for _, i in local)} on this "
                f"worker, but it trains on {list(strategy.extended.worker_devices)}. Run on "
                "hosts with that many GPUs (check CUDA_VISIBLE_DEVICES), or re-plan.")
    return tuple(plan.devices)


def make_local_cpus(plan: Plan, need: int) -> None:
    """Make ``need`` logical CPU devices on this worker (before the runtime starts)."""
    logical_cpus(need, exact=False, error=lambda have: PlanMismatchError(
        f"Plan {plan.name!r} uses {need} CPU devices on each worker, and TensorFlow's "
        "runtime has already started in this process, so no more can be added. Call "
        "apply.ensure_devices(plan) right after load_plan(), before building the model "
        "or running any TensorFlow op."))


def ensure_strategy(device_type: str, local_cpus: int = 1
                    ) -> tf.distribute.MultiWorkerMirroredStrategy:
    """The process's strategy, made from TF_CONFIG without a plan (``apply.auto_devices``
    plans later): ``local_cpus`` logical CPUs on this worker first, when training on CPUs."""
    global _STRATEGY
    if _STRATEGY is None:
        what = "This multi-worker job (TF_CONFIG)"
        if device_type == "CPU":
            logical_cpus(local_cpus, exact=True, error=lambda have: PlanMismatchError(
                f"{what} asks for {local_cpus} logical CPU devices per worker, but "
                "TensorFlow's runtime has already started. Call "
                "apply.auto_devices() before building the model."))
        _STRATEGY = _make_strategy(what, device_type)
    return _STRATEGY


def local_cpus_now() -> list[str]:
    """This process's logical CPU devices (its worker's)."""
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def local_devices(device_type: str) -> list[str]:
    """This worker's logical devices of ``device_type`` (a cluster lists every task's)."""
    _, index = read_tf_config()
    names = [d.name for d in tf.config.list_logical_devices(device_type)]
    mine = [n for n in names if tf.DeviceSpec.from_string(n).task in (index, None)]
    return mine


def _make_strategy(what: str, device_type: str) -> tf.distribute.MultiWorkerMirroredStrategy:
    impl = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=impl.RING if device_type == "CPU" else impl.AUTO)
    try:
        if device_type == "CPU" and tf.config.list_physical_devices("GPU"):
            # the strategy takes every local GPU: a CPU plan trains on CPU:0 as planned
            tf.config.set_visible_devices([], "GPU")
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except RuntimeError as e:
        if "startup" not in str(e) and "initialized" not in str(e):
            raise
        raise PlanMismatchError(
            f"{what} trains on several workers, and TensorFlow can set up its "
            "collectives only before its runtime starts, which has already happened in this "
            "process. Call apply.ensure_devices(plan) right after load_plan(), before "
            "building the model, importing a model file that creates TensorFlow objects, or "
            "running any TensorFlow op.") from None


def get_strategy() -> tf.distribute.MultiWorkerMirroredStrategy:
    """The process's MultiWorkerMirroredStrategy (made by ``ensure_cluster``)."""
    if _STRATEGY is None:
        raise PlannerError("No multi-worker strategy exists yet: call "
                           "apply.ensure_devices(plan) before apply.wrap (and before "
                           "building the model).")
    return _STRATEGY
