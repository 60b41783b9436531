"""``plan launch``: start the worker processes of a multi-worker plan, or describe them.

Pipeline position: after ``plan analyze`` wrote a plan for several workers
(``--cluster 2xcpu:1 --fix dp=2``, or ``NxPRESET``); the training script then
applies it with ``apply.wrap`` (one program per worker on the SPMD engine, its
collectives carried by the runtime ``TF_CONFIG`` configures). Imports nothing heavy: no TensorFlow here.

* ``launch_local(script, args, workers)`` picks ``workers`` free ports on
  127.0.0.1, starts one process per worker (``python SCRIPT ARGS...`` for a .py
  file, else the executable itself) with its ``TF_CONFIG`` (and ``PLAN_FILE``
  when a plan is given), streams each one's stdout and stderr line by line
  with a ``[worker i]`` prefix, and fails fast: as soon as one worker exits
  non-zero, the others (and their children) are stopped and that exit code is
  returned. 0 when every worker succeeds. Ctrl-C or SIGTERM stops every worker.
  ``restarts=N`` (``--restarts N``): when the first worker to fail was *killed* by a
  signal (SIGKILL, the OOM killer, a lost machine), the others are stopped and the
  whole job starts again, same command, new ports, up to N times; the training
  script's ``keras.callbacks.BackupAndRestore`` resumes from its last backup
  (``apply.backup``), as tf.distribute's fault-tolerance guide describes for
  MultiWorkerMirroredStrategy. A worker that exits with an error code is not
  restarted: its traceback is the answer. Each worker gets ``PLAN_LAUNCH_ATTEMPT``
  (0, then 1, ...). SIGTERM to a worker during ``fit`` with a BackupAndRestore makes
  every worker save a backup at the same step and exit 0 (``apply.backup``).
* ``check_plan_workers(plan, workers)``: before anything starts, a plan's devices
  must span exactly the requested workers (``/job:worker/task:0 .. W-1``, as
  ``plan analyze --cluster Wxcpu:N`` writes them); a one-host plan under
  ``--workers 2`` would start two independent copies that never exchange
  gradients, so it is refused (PlanMismatchError, exit 2) with the plan to make instead.
* ``tf_configs(workers, hosts, port)``: the TF_CONFIG of each worker of a real
  cluster (``--emit tf-config``); ``tfjob_manifest(...)``: a Kubeflow TFJob
  (``kubeflow.org/v1``) running the script on ``workers`` pods; the training
  operator sets TF_CONFIG in each pod itself (``--emit tfjob``).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Sequence

from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan, load_plan

LOCALHOST = "127.0.0.1"
DEFAULT_PORT = 12345  # --emit tf-config: worker i on host i listens here (or port + i)
DEFAULT_IMAGE = "tensorflow/tensorflow:2.21.0"
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
POLL_S = 0.05


def free_ports(n: int, host: str = LOCALHOST) -> list[int]:
    """``n`` distinct ports on ``host`` that were free a moment ago (all bound at once)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(addresses: Sequence[str], index: int) -> dict[str, Any]:
    """TensorFlow's cluster description for worker ``index`` of ``addresses``."""
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}


def check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlannerError(f"--workers is {workers!r}; expected a whole number >= 1 (e.g. "
                           "--workers 2).")
    return workers


_TASK = re.compile(r"^/job:worker/(?:replica:\d+/)?task:(\d+)(?:/|$)")


def plan_workers(plan: Plan) -> tuple[int, ...]:
    """The worker tasks (``/job:worker/task:i``) the plan's devices name, sorted; ()
    for a one-host plan (``/device:CPU:0``...)."""
    tasks = set()
    for device in plan.devices:
        m = _TASK.match(device)
        if m:
            tasks.add(int(m.group(1)))
    return tuple(sorted(tasks))


def check_plan_workers(plan: Plan, workers: int, path: str = "the plan") -> None:
    """PlanMismatchError unless ``plan``'s devices span exactly workers 0 .. ``workers - 1``
    (one worker: a one-host plan, or a plan for one worker task)."""
    check_workers(workers)
    tasks = plan_workers(plan)
    per_node = plan.cluster.devices_per_node
    if tasks == tuple(range(workers)) or (workers == 1 and not tasks):
        return
    if not tasks:
        raise PlanMismatchError(
            f"{path} ({plan.name!r}) runs on one host: its devices "
            f"({', '.join(plan.devices[:4])}{', ...' if len(plan.devices) > 4 else ''}) "
            f"name no worker task, so --workers {workers} would start {workers} independent "
            "copies that never exchange gradients. Make a plan for "
            f"{workers} workers: plan analyze MODEL --cluster {workers}xcpu:{per_node} "
            "--global-batch B (or NxPRESET for hosts of GPUs), then plan launch --workers "
            f"{workers}; or run this plan in one process (--workers 1).")
    raise PlanMismatchError(
        f"{path} ({plan.name!r}) uses worker task(s) {list(tasks)}, but --workers is "
        f"{workers}; a plan's devices must span exactly the workers started "
        f"(tasks 0..{workers - 1}). Launch --workers {max(tasks) + 1}, or make a plan for "
        f"{workers} worker(s): plan analyze MODEL --cluster "
        f"{workers}xcpu:{per_node} --global-batch B"
        + (" (for one worker: --cluster cpu:N)." if workers == 1 else "."))


def worker_command(script: str, args: Sequence[str], python: str = sys.executable
                   ) -> list[str]:
    """``[python, script, *args]`` for a .py file, ``[script, *args]`` for an executable."""
    if not script:
        raise PlannerError("plan launch needs a SCRIPT to run on every worker, e.g. "
                           "plan launch --workers 2 examples/train.py --plan out/plan.json.")
    if not os.path.isfile(script):
        raise PlannerError(f"Script {script!r} does not exist (looked in {os.getcwd()}). "
                           "Give the path of the training script each worker runs.")
    if script.endswith(".py"):
        return [python, script, *args]
    if not os.access(script, os.X_OK):
        raise PlannerError(f"Script {script!r} is neither a .py file nor executable; "
                           "name a Python script or make it executable (chmod +x).")
    return [os.path.abspath(script), *args]


def launch_local(script: str, args: Sequence[str], workers: int, *, plan: str | None = None,
                 python: str = sys.executable, stdout: IO[str] | None = None,
                 stderr: IO[str] | None = None, restarts: int = 0) -> int:
    """Run ``script`` on ``workers`` local processes (see the module docstring); when a
    worker is killed by a signal, start the whole job again, at most ``restarts`` times."""
    check_workers(workers)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise PlannerError(f"--restarts is {restarts!r}; expected a whole number >= 0 (e.g. "
                           "--restarts 1).")
    command = worker_command(script, args, python)
    plan_file = None
    if plan is not None:
        if not os.path.isfile(plan):
            raise PlannerError(f"--plan {plan!r} does not exist. Make one with plan analyze "
                               "MODEL --cluster 2xcpu:1 --fix dp=2 --global-batch B.")
        plan_file = os.path.abspath(plan)
        check_plan_workers(load_plan(plan_file), workers, f"--plan {plan}")
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    attempt = 0
    while True:
        code, killed = _run_job(command, workers, plan_file, stdout, stderr, attempt)
        if killed is None or attempt >= restarts:
            return code
        attempt += 1
        stderr.write(f"plan launch: worker {killed} was killed (exit code {code}); starting "
                     f"all {workers} worker(s) again (restart {attempt} of {restarts}); a "
                     "BackupAndRestore callback resumes from its last backup\n")
        stderr.flush()


def _run_job(command: list[str], workers: int, plan_file: str | None, stdout: IO[str],
             stderr: IO[str], attempt: int) -> tuple[int, int | None]:
    """One run of the job: (exit code, the worker killed by a signal or None)."""
    addresses = [f"{LOCALHOST}:{p}" for p in free_ports(workers)]
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    lock = threading.Lock()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    killed = None
    try:
        for i in range(workers):
            env = dict(os.environ, TF_CONFIG=json.dumps(tf_config(addresses, i)),
                       PYTHONUNBUFFERED="1", PLAN_LAUNCH_ATTEMPT=str(attempt))
            if plan_file is not None:
                env["PLAN_FILE"] = plan_file
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, errors="replace",
                                    start_new_session=True)  # its own group: stop children too
            procs.append(proc)
            for pipe, out in ((proc.stdout, stdout), (proc.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(pipe, out, f"[worker {i}] ", lock),
                                     daemon=True)
                t.start()
                readers.append(t)
        code, killed = _wait_fail_fast(procs, stderr, lock)
    except KeyboardInterrupt:
        code, killed = 130, None
    finally:
        _stop(procs)
        for t in readers:
            t.join(timeout=2.0)
        if main:
            signal.signal(signal.SIGTERM, previous)
    return code, killed


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM to ``plan launch`` stops its workers too (as Ctrl-C does)."""
    raise KeyboardInterrupt


def _pump(pipe: IO[str], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for line in pipe:
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    pipe.close()


def _wait_fail_fast(procs: list[subprocess.Popen], stderr: IO[str],
                    lock: threading.Lock) -> tuple[int, int | None]:
    """(exit code, the worker that was killed by a signal, or None) of the first worker
    to fail; (0, None) when every worker succeeds."""
    while True:
        running = 0
        for i, proc in enumerate(procs):
            rc = proc.poll()
            if rc is None:
                running += 1
            elif rc != 0:
                others = [j for j, p in enumerate(procs) if j != i and p.poll() is None]
                with lock:
                    stderr.write(f"plan launch: worker {i} exited with code {rc}"
                                 + (f"; stopping worker(s) {others}" if others else "") + "\n")
                    stderr.flush()
                if rc > 0:
                    return rc, None
                return 128 - rc, i  # killed by signal n: 128 + n
        if not running:
            return 0, None
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every running worker's process group; SIGKILL what is left after a grace."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- describing a real cluster --------------------------------------------------------------

def worker_addresses(workers: int, hosts: Sequence[str] | None, port: int = DEFAULT_PORT
                     ) -> list[str]:
    """``host:port`` of each worker: one per host (``--hosts``), or 127.0.0.1:port+i."""
    check_workers(workers)
    if not hosts:
        return [f"{LOCALHOST}:{port + i}" for i in range(workers)]
    hosts = [h.strip() for h in hosts if h.strip()]
    if len(hosts) != workers:
        raise PlannerError(f"--hosts names {len(hosts)} host(s) ({', '.join(hosts)}) for "
                           f"--workers {workers}; give one host per worker.")
    return [h if ":" in h else f"{h}:{port}" for h in hosts]


def tf_configs(workers: int, hosts: Sequence[str] | None = None, port: int = DEFAULT_PORT
               ) -> dict[str, Any]:
    """``{"cluster": ..., "workers": [{"address", "TF_CONFIG"}, ...]}`` (``--emit tf-config``).

    Set worker i's TF_CONFIG (a JSON string) in its environment, then start the same
    script on every host.
    """
    addresses = worker_addresses(workers, hosts, port)
    return {"cluster": {"worker": addresses},
            "workers": [{"index": i, "address": a, "TF_CONFIG": tf_config(addresses, i)}
                        for i, a in enumerate(addresses)]}


def tfjob_manifest(workers: int, command: Sequence[str], *, name: str = "plan-train",
                   image: str = DEFAULT_IMAGE, plan: str | None = None) -> dict[str, Any]:
    """A Kubeflow TFJob (kubeflow.org/v1) with ``workers`` Worker replicas.

    The training operator writes TF_CONFIG into each pod (container name
    ``tensorflow``, port 2222); ``plan`` becomes PLAN_FILE (a path inside the image);
    when that path is also a file here, its devices must span the ``workers``
    (``check_plan_workers``).
    """
    check_workers(workers)
    if plan is not None and os.path.isfile(plan):
        check_plan_workers(load_plan(plan), workers, f"--plan {plan}")
    container: dict[str, Any] = {"name": "tensorflow", "image": image,
                                 "command": list(command)}
    if plan is not None:
        container["env"] = [{"name": "PLAN_FILE", "value": plan}]
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": name},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None"},
            "tfReplicaSpecs": {
                "Worker": {
                    "replicas": workers,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [container]}},
                },
            },
        },
    }
