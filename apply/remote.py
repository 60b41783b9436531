"""Plans whose replicas span worker processes: worker 0 drives every device (remote eager).

Pipeline position: ``apply.ensure_devices`` calls ``ensure_remote_cluster`` for a plan
whose devices span several workers (``/job:worker/task:w/device:CPU:i``) and that the
SPMD engine (``apply.spmd``) cannot run with one program per worker
(``apply.mode.Processes.REMOTE``): a data-parallel replica whose pipeline stages lie on
several workers (the Megatron layout that puts pp across nodes, a ``pp`` plan over
``Wxcpu:1``), or a general placement across workers. ``apply.wrap`` then runs the plan
with the one-host modes (``apply.pipeline``, ``apply.tensor_parallel``), whose
``tf.device`` names are the plan's worker device names.

* One client: worker 0 (the chief) connects to the whole cluster from TF_CONFIG
  (``tf.config.experimental_connect_to_cluster``), after which every worker's devices are
  this process's devices (``tf.config.list_logical_devices`` lists them) and TensorFlow
  runs each op, variable and optimizer slot on the worker its ``tf.device`` names,
  sending tensors between workers over gRPC (a traced step is partitioned per worker).
  So the model trains exactly as on one host: the same losses, every variable where the
  plan puts it.
* The other workers only serve their devices: ``ensure_devices`` there starts a
  ``tf.distribute.Server`` for the worker's task (with the plan's logical CPU count),
  prints what it does, waits until worker 0's server has come and gone (a TCP probe of
  its address every ``PROBE_INTERVAL_S``), then ends the process with exit code 0; the
  rest of the script does not run there. ``plan launch`` still fails fast if any worker
  fails, and exits with worker 0's code.
* Worker 0 waits for the other workers' servers before connecting (up to
  ``CONNECT_TIMEOUT_S``; a clear error names the worker that did not come up).

This is TensorFlow's own single-client model (the coordinator of
``ParameterServerStrategy`` uses it). ``MultiWorkerMirroredStrategy`` cannot be mixed
in: under it a remote variable crashes the process (checked with TF 2.21), so a job
runs one way or the other, chosen from the plan before TensorFlow starts.
"""
from __future__ import annotations

import os
import socket
import sys
import time

from tfplan.apply.device_names import short_name
from tfplan.apply.mode import plan_tasks
from tfplan.apply.workers import check_workers, make_local_cpus, read_tf_config
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan

CONNECT_TIMEOUT_S = 600.0  # how long the chief waits for the others, and they for it
PROBE_INTERVAL_S = 0.5
NOTICE_INTERVAL_S = 10.0  # how often a wait says what it waits for
_CONNECTED: tuple[tuple[str, ...], int] | None = None  # (cluster addresses, CPUs per worker)


def ensure_remote_cluster(plan: Plan) -> tuple[str, ...]:
    """Worker 0: connect to the cluster and check the plan's devices; return them.
    Other workers: serve this worker's devices until worker 0 is done, then exit 0.

    Must run before TensorFlow's runtime starts (before any model is built), like
    ``apply.ensure_devices``.
    """
    global _CONNECTED
    import tensorflow as tf

    tasks = plan_tasks(plan)
    workers, index = read_tf_config()
    check_workers(plan, tasks, workers)
    types = {t for devices in tasks.values() for t, _ in devices}
    if len(types) != 1:
        raise PlanMismatchError(f"Plan {plan.name!r} mixes device types {sorted(types)}; "
                                "expected one type. Regenerate the plan.")
    device_type = types.pop()
    # the cluster's devices per worker (Wxcpu:N), at least those the plan names
    used = 1 + max(i for devices in tasks.values() for _, i in devices)
    cpus = max(used, plan.cluster.devices_per_node) if device_type == "CPU" else 1
    if _CONNECTED is not None:  # a second plan in the same job: the same cluster only
        if _CONNECTED[0] != tuple(workers) or (device_type == "CPU" and used > _CONNECTED[1]):
            raise PlanMismatchError(
                f"Plan {plan.name!r} needs {used} CPU device(s) on each of workers "
                f"{workers}, but this process is already connected to "
                f"{list(_CONNECTED[0])} with {_CONNECTED[1]}; one process serves one "
                "cluster. Use plans made for the same cluster.")
        return _check_devices(plan)
    if device_type == "CPU":
        make_local_cpus(plan, cpus)
    if index != 0:
        _serve(plan, workers, index, device_type, cpus)  # does not return
    others = [a for i, a in enumerate(workers) if i != 0]
    for i, address in enumerate(workers):
        if i and not _wait_until(address, up=True, timeout_s=CONNECT_TIMEOUT_S,
                                 waiting=f"worker {i} ({address}) to serve its devices"):
            raise PlannerError(
                f"Worker {i} ({address}) did not start serving its devices within "
                f"{CONNECT_TIMEOUT_S:.0f} s, so plan {plan.name!r} cannot run. Start the same "
                "script on every worker (plan launch --workers "
                f"{len(workers)} SCRIPT), and check that worker's log.")
    cluster = tf.train.ClusterSpec({"worker": list(workers)})
    try:
        tf.config.experimental_connect_to_cluster(cluster, job_name="worker", task_index=0,
                                                  protocol="grpc")
    except (RuntimeError, ValueError) as e:
        raise PlanMismatchError(
            f"Plan {plan.name!r} runs across workers {workers}, but connecting to them failed "
            f"({type(e).__name__}: {e}). Call apply.ensure_devices(plan) right after "
            "load_plan(), before building the model or running any TensorFlow op.") from None
    _CONNECTED = (tuple(workers), cpus)
    print(f"[apply] plan {plan.name!r}: this worker (0) drives the devices of all "
          f"{len(workers)} workers ({len(others)} serving)", file=sys.stderr, flush=True)
    return _check_devices(plan)


def _check_devices(plan: Plan) -> tuple[str, ...]:
    import tensorflow as tf

    have = {short_name(d.name) for d in tf.config.list_logical_devices()}
    missing = [d for d in plan.devices if short_name(d) not in have]
    if missing:
        raise PlanMismatchError(
            f"Plan {plan.name!r} needs devices {missing}, which the cluster does not have. "
            f"Devices it has: {sorted(have)}. Plan for the cluster's devices, or start the "
            "workers with more devices.")
    return tuple(plan.devices)


def _serve(plan: Plan, workers: list[str], index: int, device_type: str, cpus: int) -> None:
    """Serve this worker's devices to worker 0 until it is done; then exit the process."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus}) \
        if device_type == "CPU" else None
    cluster = tf.train.ClusterSpec({"worker": list(workers)})
    server = tf.distribute.Server(cluster, job_name="worker", task_index=index,
                                  protocol="grpc", config=config, start=True)
    print(f"[apply] plan {plan.name!r} spans workers, so worker 0 runs the training; this "
          f"worker ({index}) serves its devices to it and exits when worker 0 is done",
          file=sys.stderr, flush=True)
    chief = workers[0]
    if not _wait_until(chief, up=True, timeout_s=CONNECT_TIMEOUT_S,
                       waiting=f"worker 0 ({chief}) to start"):
        print(f"[apply] worker 0 ({chief}) did not come up within "
              f"{CONNECT_TIMEOUT_S:.0f} s; stopping", file=sys.stderr, flush=True)
        os._exit(1)
    _wait_until(chief, up=False, timeout_s=None)
    del server
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # TensorFlow's server threads would keep a normal exit waiting


def _wait_until(address: str, *, up: bool, timeout_s: float | None,
                waiting: str = "") -> bool:
    """Probe ``host:port`` until it accepts connections (``up``) or refuses them; says
    on stderr what it waits for every ``NOTICE_INTERVAL_S`` (when ``waiting`` is given)."""
    host, port = address.rsplit(":", 1)
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    next_notice = start + NOTICE_INTERVAL_S
    while deadline is None or time.monotonic() < deadline:
        if _accepts(host.strip("[]"), int(port)) == up:
            return True
        if waiting and time.monotonic() >= next_notice:
            print(f"[apply] still waiting for {waiting} ({time.monotonic() - start:.0f} s of "
                  f"{timeout_s:.0f} s)", file=sys.stderr, flush=True)
            next_notice += NOTICE_INTERVAL_S
        time.sleep(PROBE_INTERVAL_S)
    return False


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False
