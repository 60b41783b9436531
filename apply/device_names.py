"""Device names and this process's logical CPU devices.

Pipeline position: the bottom of ``apply``, under everything that names or makes a
device: ``apply.devices`` (``ensure_devices``), ``apply.workers`` (a worker's devices),
``apply.placement`` and ``apply.auto``. A plan names its devices
``/device:GPU:i`` or ``/device:CPU:i`` on one host, ``/job:worker/task:w/device:CPU:i``
across workers; ``parse_device`` reads a one-host name, ``short_name`` turns
TensorFlow's full names into the plan's, and ``logical_cpus`` makes logical CPU devices
(possible only before TensorFlow's runtime starts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tfplan.core.errors import PlanMismatchError, PlannerError

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
