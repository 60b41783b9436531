"""A lost worker, said as such: the error a collective raises when a peer is gone.

Pipeline position: around every entry point of ``SpmdModel`` that runs steps (``fit``,
``evaluate``, ``predict``, the ``*_on_batch`` calls), one program per worker.

How a failure ends the job (measured on two local workers training the tiny MLP, dp = 2;
``tests/apply/test_backup_restore_workers.py`` checks it): the collective runtime that
``apply.ensure_devices`` starts (``tf.distribute.MultiWorkerMirroredStrategy``'s set-up)
runs TensorFlow's coordination service on worker 0, each worker sending it heartbeats.

* A worker that dies (SIGKILL, the OOM killer, a lost host) or hangs (SIGSTOP, a wedged
  driver) stops sending them: after the service's heartbeat timeout (10 s) every other
  worker's collectives are aborted with "The following tasks are unhealthy (stopped
  sending heartbeats): /job:worker/replica:0/task:1" (measured: 9.7 s after a SIGKILL,
  10.0 s after a SIGSTOP).
* Worker 0 dying: the others' next transfer from it fails at once ("Failed to connect to
  remote host", 1.8 s); worker 0 hanging: their heartbeats to its service time out
  ("Deadline Exceeded ... CoordinationService/Heartbeat", 10.1 s).

``lost_workers`` reads those messages; ``worker_failures`` turns the error into a
``WorkerLostError`` naming the worker(s) and the fix (restart the job; ``BackupAndRestore``
resumes it), so the script exits non-zero with that message within about 10 s of the
failure, instead of waiting for ever. No collective carries a timeout of its own: TensorFlow
2.21 serves one with a thread per collective (``apply.collective_ops.TIMEOUT_S``).
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

import tensorflow as tf

from tfplan.core.errors import WorkerLostError

ABORTED = "Collective ops is aborted by"
_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):((?:\s*/job:\w+/replica:\d+"
                        r"/task:\d+)+)")
_TASK = re.compile(r"/job:\w+/replica:\d+/task:(\d+)")
_UNREACHABLE = re.compile(r"Failed to connect to remote host.*?remote target "
                          r"/job:\w+/replica:\d+/task:(\d+)", re.S)


def lost_workers(message: str) -> tuple[tuple[int, ...], str] | None:
    """(the workers named, what happened to them) from a collective's error message; None
    where it is not a lost worker (module docstring)."""
    if ABORTED not in message and "stopped sending heartbeats" not in message:
        return None
    found = _UNHEALTHY.search(message)
    if found:
        tasks = tuple(sorted({int(t) for t in _TASK.findall(found.group(1))}))
        return tasks, "stopped sending heartbeats to the coordination service (it died or hung)"
    found = _UNREACHABLE.search(message)
    if found:
        return (int(found.group(1)),), "cannot be reached (its process is gone)"
    if "CoordinationService/Heartbeat" in message:
        return (0,), ("does not answer heartbeats: worker 0 runs the coordination service, "
                      "and it died or hung")
    return (), "aborted the collectives (TensorFlow names no worker)"


@contextlib.contextmanager
def worker_failures(plan_name: str) -> Iterator[None]:
    """A collective aborted because a worker was lost, raised as ``WorkerLostError``."""
    try:
        yield
    except tf.errors.OpError as e:
        found = lost_workers(str(e.message if hasattr(e, "message") else e))
        if found is None:
            raise
        tasks, what = found
        named = ", ".join(f"worker {t}" for t in tasks) or "a worker"
        raise WorkerLostError(
            f"Plan {plan_name!r}: {named} {what}, so this worker's collectives were "
            "aborted and the job cannot go on. Restart the whole job (plan launch "
            "--restarts N, or your scheduler's restart policy); with "
            "keras.callbacks.BackupAndRestore it resumes from the last backup. "
            f"TensorFlow said: {_first_lines(str(e))}", tasks) from None


def _first_lines(message: str, n: int = 4) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:n])

