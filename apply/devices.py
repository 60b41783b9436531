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
  ``apply.multi_worker.ensure_cluster`` checks them against TF_CONFIG and makes
  the MultiWorkerMirroredStrategy (``plan launch`` starts such workers); when a
  data-parallel replica spans workers, ``apply.remote.ensure_remote_cluster`` connects
  worker 0 to them all instead (the others serve their devices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan

DEVICE_TYPES = ("CPU", "GPU")


@dataclass(frozen=True)
class LocalDevice:
    """A plan's device name on this host: ``/device:{device_type}:{index}``."""

    device_type: str
    index: int

    @property
    def name(self) -> str:
        return f"/device:{self.device_type}:{self.index}"


def parse_device(name: str) -> LocalDevice:
    """Parse a plan's device name (``/device:GPU:3``); reject multi-worker names."""
    import tensorflow as tf

    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError) as e:
        raise PlanMismatchError(
            f"The plan names device {name!r}, which is not a TensorFlow device name ({e}). "
            "Expected '/device:GPU:i' or '/device:CPU:i'; regenerate the plan.") from None
    if spec.job not in (None, "localhost") or spec.task not in (None, 0) \
            or spec.replica not in (None, 0):
        raise PlannerError(
            f"The plan names device {name!r} on a worker of a multi-node cluster, but uses "
            "only one worker's devices; apply runs such a plan on one host. Plan for one node "
            "(e.g. --cluster 8xA100-80GB, or cpu:N), or for every worker of the cluster and "
            "start them with `plan launch --workers W`.")
    device_type = (spec.device_type or "").upper()
    if device_type not in DEVICE_TYPES or spec.device_index is None:
        raise PlanMismatchError(
            f"The plan names device {name!r}; expected '/device:GPU:i' or '/device:CPU:i' "
            "with an index. Regenerate the plan.")
    return LocalDevice(device_type, int(spec.device_index))


def short_name(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``/device:CPU:1``; a worker's
    device keeps its job and task, as plans name it: ``/job:worker/task:1/device:CPU:0``."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    if spec.device_type is None or spec.device_index is None:
        return device
    local = f"/device:{spec.device_type.upper()}:{spec.device_index}"
    if spec.job not in (None, "localhost") and spec.task is not None:
        return f"/job:{spec.job}/task:{spec.task}{local}"
    return local


def logical_cpus(count: int, *, exact: bool, error: Callable[[int], Exception]) -> None:
    """Give this process ``count`` logical CPU devices (``exact``: exactly that many; else
    at least), before TensorFlow's runtime starts. ``error(have)`` is raised when the
    runtime has started with ``have`` devices and they cannot be changed."""
    import tensorflow as tf

    physical = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(physical)
    have = len(configured) if configured else 1
    if have == count or (have > count and not exact):
        return
    try:
        tf.config.set_logical_device_configuration(
            physical, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    except RuntimeError:  # the runtime has started: the device list is fixed
        raise error(have) from None


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


def ensure_devices(plan: Plan) -> tuple[str, ...]:
    """Make the plan's devices exist (CPU) or check that they do (GPU); return their names.

    Raises PlanMismatchError when they cannot exist; multi-worker plans go to
    ``apply.multi_worker.ensure_cluster``.
    """
    import tensorflow as tf

    if not plan.devices:
        raise PlanMismatchError(f"Plan {plan.name!r} names no devices (its stages are empty). "
                                "Regenerate the plan.")
    from tfplan.apply import multi_worker

    if multi_worker.spans_workers(plan):
        from tfplan.apply import remote

        if remote.needs_remote(plan):  # a replica across workers: worker 0 drives them all
            return remote.ensure_remote_cluster(plan)
        return multi_worker.ensure_cluster(plan)
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
