"""Making sure the devices a plan names exist in this process.

Pipeline position: the first thing ``apply.wrap`` does with a ``Plan`` (after
checking it against the model), and what a training script calls right after
``load_plan`` and before building its model: on CPU, TensorFlow's logical
devices can only be configured before its runtime starts, and building a Keras
model starts it.

* ``/device:CPU:i`` plans: if the runtime has not started, configure ``max(i)+1``
  logical CPU devices (``tf.config.set_logical_device_configuration``); if the
  process already has enough, do nothing; otherwise raise PlanMismatchError
  listing what exists.
* ``/device:GPU:i`` plans: check that the GPUs exist (nothing is configured).
* ``/job:worker/task:w/...`` names on several workers (multi-node plans):
  ``apply.workers.ensure_cluster`` checks them against TF_CONFIG and makes
  the MultiWorkerMirroredStrategy (``plan launch`` starts such workers).
"""
from __future__ import annotations

from tfplan.apply.device_names import LocalDevice, logical_cpus, parse_device, short_name
from tfplan.apply.mode import ExecutionMode, Processes, run_processes
from tfplan.apply.workers import ensure_cluster
from tfplan.core.errors import PlanMismatchError
from tfplan.planner.plan import Plan


def _existing(device_type: str) -> list[str]:
    import tensorflow as tf

    return [short_name(d.name) for d in tf.config.list_logical_devices(device_type)]


def _mismatch(needed: list[LocalDevice], device_type: str, why: str, fix: str) -> PlanMismatchError:
    import tensorflow as tf

    exist = [short_name(d.name) for d in tf.config.list_logical_devices()]
    want = sorted({d.name for d in needed}, key=lambda n: int(n.rsplit(":", 1)[1]))
    return PlanMismatchError(
        f"The plan needs {device_type} devices {want}, but {why}. Devices this process has: "
        f"{exist}. {fix}")


def ensure_devices(plan: Plan, *, mode: ExecutionMode | None = None) -> tuple[str, ...]:
    """Make the plan's devices exist (CPU) or check that they do (GPU); return their names.

    Raises PlanMismatchError when they cannot exist; multi-worker plans go to
    ``apply.workers.ensure_cluster`` (one program per worker). ``mode``: the
    plan's ``apply.mode.execution_mode`` when the caller has it (``apply.wrap``).
    """
    if not plan.devices:
        raise PlanMismatchError(f"Plan {plan.name!r} names no devices (its stages are empty). "
                                "Regenerate the plan.")
    processes = run_processes(plan) if mode is None else mode.processes
    if processes is Processes.PER_WORKER:
        return ensure_cluster(plan)
    parsed = [parse_device(d) for d in plan.devices]
    types = sorted({d.device_type for d in parsed})
    if len(types) > 1:
        raise PlanMismatchError(
            f"Plan {plan.name!r} mixes device types {types}; expected one type. "
            "Regenerate the plan.")
    device_type = types[0]
    need = max(d.index for d in parsed) + 1
    if device_type == "CPU":
        logical_cpus(need, exact=False, error=lambda have: _mismatch(
            parsed, "CPU", f"TensorFlow's runtime has already started with {have} "
            "logical CPU device(s), and no more can be added now",
            "Call apply.ensure_devices(plan) right after load_plan(), before building "
            "the model or running any TensorFlow op, or plan for fewer devices "
            f"(--cluster cpu:{have})."))
    existing = set(_existing(device_type))
    missing = [d for d in parsed if d.name not in existing]
    if missing:
        fix = (f"Plan for the devices this machine has (--cluster cpu:{len(existing)})."
               if device_type == "CPU" else
               "Run on a machine with that many GPUs (check CUDA_VISIBLE_DEVICES and "
               "`nvidia-smi`), or plan for the GPUs this machine has.")
        raise _mismatch(parsed, device_type,
                        f"{sorted(d.name for d in missing)} do not exist", fix)
    return tuple(d.name for d in parsed)
