"""apply.spmd.failures: the messages TensorFlow 2.21 gives when a worker is lost (copied
from two local workers: worker 1 SIGKILLed or SIGSTOPped, worker 0 SIGKILLed or
SIGSTOPped), read as the workers they name; other errors left alone."""
from __future__ import annotations

import pytest
import tensorflow as tf

from tfplan.apply.spmd.failures import lost_workers, worker_failures
from tfplan.core.errors import WorkerLostError

UNHEALTHY = """Collective ops is aborted by: Error reported from /job:worker/task:1: The \
following tasks are unhealthy (stopped sending heartbeats):
/job:worker/replica:0/task:1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events \
(e.g. preemption, eviction) to debug further.
The error could be from a previous operation. Restart your program to reset.
\t [[{{node tfplan_all_reduce_dp/CollectiveReduceV2}}]] [Op:__inference_multi_step_1622]"""
LEADER_GONE = """Collective ops is aborted by: failed to connect to all addresses; last \
error: UNKNOWN: ipv4:127.0.0.1:35459: Failed to connect to remote host: Connection refused
Additional GRPC error information from remote target /job:worker/replica:0/task:0 while \
calling /tensorflow.WorkerService/RecvBuf:
The error could be from a previous operation. Restart your program to reset."""
LEADER_HUNG = """Collective ops is aborted by: Deadline Exceeded

RPC: /tensorflow.CoordinationService/Heartbeat
The error could be from a previous operation. Restart your program to reset."""


@pytest.mark.parametrize("message,tasks,what", [
    (UNHEALTHY, (1,), "stopped sending heartbeats"),
    (LEADER_GONE, (0,), "cannot be reached"),
    (LEADER_HUNG, (0,), "worker 0 runs the coordination service"),
    ("Collective ops is aborted by: something else", (), "TensorFlow names no worker"),
])
def test_the_lost_worker_is_read_from_the_message(message, tasks, what):
    found, said = lost_workers(message)
    assert found == tasks and what in said


def test_other_errors_pass_through_and_a_lost_worker_is_named():
    assert lost_workers("Incompatible shapes: [4,8] vs. [4,6]") is None
    with pytest.raises(tf.errors.InvalidArgumentError):
        with worker_failures("p"):
            raise tf.errors.InvalidArgumentError(None, None, "Incompatible shapes")
    with pytest.raises(WorkerLostError, match="Plan 'p': worker 1 stopped sending") as e:
        with worker_failures("p"):
            raise tf.errors.UnavailableError(None, None, UNHEALTHY)
    assert e.value.tasks == (1,) and "Restart the whole job" in str(e.value)
