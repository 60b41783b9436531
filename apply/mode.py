"""How a plan runs: one ``ExecutionMode``, decided once from the plan's shape and devices.

Pipeline position: the bottom of ``apply`` (it imports no other ``apply`` module).
``apply.wrap`` computes ``execution_mode(plan)`` once and dispatches on it;
``apply.ensure_devices`` sets up the processes ``run_processes(plan)`` names;
``apply.auto`` asks it whether a searched plan is runnable. Nothing here touches a
device or TF_CONFIG: the decision is a function of the plan alone.

Two parts:

* ``Processes``: who runs the plan. ``ONE_HOST``: this process drives every device
  (a plan without ``/job:worker`` names, or one worker's). ``PER_WORKER``: one program
  per worker process, a MultiWorkerMirroredStrategy between them (``apply.multi_worker``,
  ``apply.multi_worker_hybrid``), when every data-parallel replica lies on one worker.
  ``REMOTE``: worker 0 drives every worker's devices (``apply.remote``), when a replica
  (its pipeline stages or tp ranks) spans workers, or a general placement spans them, or
  the plan is expert parallel (``ep > 1``: its tokens travel between the replicas of an
  ep group as placed transfers inside one graph, ``apply.expert_parallel``; one program
  per worker has no such transfers, so every multi-worker ep plan runs here, also one
  whose ep groups lie inside workers).
* ``Mode``: what the model does, the names ``apply.wrap``'s docstring lists:
  ``single_device``, ``pipeline``, ``placement`` (a general placement),
  ``data_parallel``, ``tensor_parallel`` (tp > 1, dp x pp, ZeRO-1 with dp > 1, or
  ep > 1: the replicas as copies in one graph, never MirroredStrategy),
  ``context_parallel`` (cp > 1),
  ``multi_worker`` (one device per worker, data parallel) and ``multi_worker_hybrid``
  (anything more per worker, or ZeRO-1 across workers). A ``REMOTE`` plan runs the
  one-host mode of its shape.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import tensorflow as tf

from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan


class Processes(str, enum.Enum):
    """Which processes run the plan (see the module docstring)."""

    ONE_HOST = "one_host"
    PER_WORKER = "per_worker"
    REMOTE = "remote"


class Mode(str, enum.Enum):
    """What the wrapped model does (see the module docstring); the value is the name
    ``apply.wrap`` documents, so ``mode == "tensor_parallel"`` reads as it says."""

    SINGLE_DEVICE = "single_device"
    PIPELINE = "pipeline"
    PLACEMENT = "placement"
    DATA_PARALLEL = "data_parallel"
    TENSOR_PARALLEL = "tensor_parallel"
    CONTEXT_PARALLEL = "context_parallel"
    MULTI_WORKER = "multi_worker"
    MULTI_WORKER_HYBRID = "multi_worker_hybrid"


@dataclass(frozen=True)
class ExecutionMode:
    """How a plan runs: ``mode`` on ``processes``.

    ``worker_tasks``: the worker tasks the plan's devices name, ascending (empty for a
    one-host plan). ``replica_tasks``: the worker of each data-parallel replica, for a
    ``PER_WORKER`` plan (empty otherwise).
    """

    mode: Mode
    processes: Processes
    worker_tasks: tuple[int, ...] = ()
    replica_tasks: tuple[int, ...] = ()

    @property
    def remote(self) -> bool:
        """Worker 0 drives every worker's devices (``apply.remote``)."""
        return self.processes is Processes.REMOTE


# --- the plan's workers ----------------------------------------------------------------------

def plan_tasks(plan: Plan) -> dict[int, list[tuple[str, int]]]:
    """{worker task: [(device type, index), ...]} for a plan with ``/job:worker`` names.

    Empty when the plan names no ``/job:worker`` devices (a one-host plan).
    """
    tasks: dict[int, list[tuple[str, int]]] = {}
    for name in plan.devices:
        spec = tf.DeviceSpec.from_string(name)
        if spec.job != "worker":
            continue
        if spec.task is None or spec.device_type is None or spec.device_index is None:
            raise PlanMismatchError(
                f"Plan {plan.name!r} names device {name!r}; expected "
                "'/job:worker/task:w/device:CPU:i' (or GPU). Regenerate the plan.")
        tasks.setdefault(int(spec.task), []).append((spec.device_type.upper(),
                                                     int(spec.device_index)))
    return tasks


def _replica_workers(plan: Plan) -> list[set[int | None]]:
    """The worker tasks of each data-parallel replica's devices (its stages, its tp ranks)."""
    tp = max(1, plan.strategy.tp)
    return [{tf.DeviceSpec.from_string(d).task for stage in plan.stages
             for d in stage.devices[r * tp:(r + 1) * tp]}
            for r in range(plan.strategy.dp)]


def replicas_span_workers(plan: Plan) -> bool:
    """True when some data-parallel replica's devices (its stages, its tp ranks) are on
    more than one worker."""
    return any(len(where) > 1 for where in _replica_workers(plan))


def plan_replica_tasks(plan: Plan) -> list[int]:
    """The worker task of each data-parallel replica of a multi-worker plan.

    PlannerError naming the replica when one replica's devices (its stages, its tp
    ranks) are on several workers: apply runs a replica inside one worker process.
    """
    return _replica_tasks(plan, _replica_workers(plan))


def _replica_tasks(plan: Plan, replica_workers: list[set[int | None]]) -> list[int]:
    tasks = []
    for r, where in enumerate(replica_workers):
        if len(where) != 1:
            raise PlannerError(
                f"Plan {plan.name!r} runs data-parallel replica {r} on workers "
                f"{sorted(w for w in where if w is not None)}: its pipeline stages or tensor "
                "ranks span worker processes. apply runs each replica inside one worker "
                "(MultiWorkerMirroredStrategy between workers, placement within). Re-plan "
                "with the dp-outer layout (plan analyze --layout tp-pp-dp) or with "
                "pp x tp no larger than one worker's devices.")
        tasks.append(int(where.pop()))
    return tasks


def is_hybrid(plan: Plan, tasks: dict[int, list[tuple[str, int]]] | None = None) -> bool:
    """True for a multi-worker plan that is more than one device per worker doing data
    parallelism (pipeline, tensor parallel, or several replicas on a worker).
    ``tasks``: ``plan_tasks(plan)`` when the caller has it."""
    s = plan.strategy
    tasks = plan_tasks(plan) if tasks is None else tasks
    per_worker = {len(devices) for devices in tasks.values()}
    return s.pp > 1 or s.tp > 1 or per_worker != {1}


def run_processes(plan: Plan) -> Processes:
    """Which processes run ``plan`` (no other check of the plan; ``apply.ensure_devices``
    sets them up)."""
    tasks = plan_tasks(plan)
    return _processes(plan, tasks, _replica_workers(plan) if len(tasks) > 1 else [])


def _processes(plan: Plan, tasks: dict[int, list[tuple[str, int]]],
               replica_workers: list[set[int | None]]) -> Processes:
    if len(tasks) <= 1:
        return Processes.ONE_HOST
    if (plan.placement == "general" or any(len(where) > 1 for where in replica_workers)
            or plan.strategy.ep > 1):  # expert parallel: transfers between replicas
        return Processes.REMOTE
    return Processes.PER_WORKER


# --- the decision ----------------------------------------------------------------------------

def execution_mode(plan: Plan) -> ExecutionMode:
    """How ``plan`` runs; PlanMismatchError / PlannerError for plans apply cannot run."""
    s = plan.strategy
    replicas = {len(stage.devices) for stage in plan.stages}
    if not plan.stages or replicas == {0}:
        raise PlanMismatchError(f"Plan {plan.name!r} has no stages or no devices. "
                                "Regenerate the plan.")
    if len(replicas) != 1:
        raise PlanMismatchError(
            f"Plan {plan.name!r} has stages with different numbers of replicas "
            f"({sorted(replicas)}); every stage needs one device per data-parallel replica. "
            "Regenerate the plan.")
    # an interleaved pipeline has virtual_stages model chunks per device
    # (a stage lists dp * cp * tp devices, tensor rank innermost: planner.plan)
    per_replica = max(1, s.tp) * max(1, s.cp)
    dp, pp = replicas.pop() // per_replica, len(plan.stages) // max(1, s.virtual_stages)
    if (s.dp, s.pp) != (dp, pp):
        raise PlanMismatchError(
            f"Plan {plan.name!r} says dp={s.dp}, pp={s.pp}, but its stages describe "
            f"dp={dp} (devices per stage / (tp * cp)) and pp={pp} (stages). Regenerate "
            "the plan.")
    tasks = plan_tasks(plan)
    if tasks and len(tasks) < plan.cluster.num_nodes:
        raise PlannerError(
            f"Plan {plan.name!r} uses {len(tasks)} of its cluster's {plan.cluster.num_nodes} "
            "workers; apply runs a multi-worker job on every worker, so the plan must use "
            "them all. Re-plan for fewer workers (plan launch --workers "
            f"{len(tasks)}) or with a strategy over every worker (e.g. --fix "
            f"dp={plan.cluster.num_nodes}).")
    replica_workers = _replica_workers(plan) if len(tasks) > 1 else []
    processes = _processes(plan, tasks, replica_workers)
    workers = tuple(sorted(tasks))
    if processes is Processes.PER_WORKER:  # one program per worker
        if is_hybrid(plan, tasks) or s.optimizer_sharding:  # pp / tp / local replicas / ZeRO-1
            replica_tasks = tuple(_replica_tasks(plan, replica_workers))
            return ExecutionMode(Mode.MULTI_WORKER_HYBRID, processes, workers, replica_tasks)
        return ExecutionMode(Mode.MULTI_WORKER, processes, workers)
    # below: one process drives every device (one host, or worker 0 of a cluster whose
    # replicas span workers: apply.remote), with the plan's device names
    if s.cp > 1:  # apply.context_parallel (apply.dimensions says which shapes run)
        return ExecutionMode(Mode.CONTEXT_PARALLEL, processes, workers)
    if s.tp > 1 or (dp > 1 and pp > 1) or (dp > 1 and s.optimizer_sharding) or s.ep > 1:
        # apply.tensor_parallel: any dp (one host) and pp; with tp = 1 and dp x pp it is a
        # pipeline replicated dp times, the gradients summed across the replicas; ZeRO-1
        # (optimizer_sharding) runs there too, each replica updating its share
        # (apply.zero); so does expert parallelism (ep > 1: apply.expert_parallel)
        return ExecutionMode(Mode.TENSOR_PARALLEL, processes, workers)
    if plan.placement == "general":
        if dp > 1 or s.num_microbatches != 1:
            raise PlanMismatchError(
                f"Plan {plan.name!r} is a general placement with dp={dp} and "
                f"num_microbatches={s.num_microbatches}; a general placement runs one batch "
                "with one device per stage (dp=1, num_microbatches=1). Regenerate the plan.")
        return ExecutionMode(Mode.PLACEMENT, processes, workers)
    if dp > 1:
        return ExecutionMode(Mode.DATA_PARALLEL, processes, workers)
    return ExecutionMode(Mode.PIPELINE if pp > 1 else Mode.SINGLE_DEVICE, processes, workers)
