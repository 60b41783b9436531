"""How a plan runs: one ``ExecutionMode``, decided once from the plan's shape and devices.

Pipeline position: the bottom of ``apply`` (it imports no other ``apply`` module).
``apply.wrap`` computes ``execution_mode(plan)`` once and dispatches on it;
``apply.ensure_devices`` sets up the processes ``run_processes(plan)`` names;
``apply.auto`` asks it whether a searched plan is runnable. Nothing here touches a
device or TF_CONFIG: the decision is a function of the plan alone.

Two parts:

* ``Processes``: who runs the plan. ``ONE_HOST``: this process drives every device
  (a plan without ``/job:worker`` names, or one worker's). ``PER_WORKER``: one program
  per worker process, each running its own devices' part of the SPMD engine
  (``apply.spmd``: the collectives span the workers, TF_CONFIG's collective runtime
  carries them; a column whose pipeline chunks lie on several workers passes its
  activations between them by two-member collectives).
* ``Mode``: what the model does, the names ``apply.wrap``'s docstring lists:
  ``single_device``, ``pipeline``, ``placement`` (a general placement),
  ``data_parallel``, ``tensor_parallel`` (tp > 1, dp x pp, ZeRO-1 with dp > 1, or
  ep > 1), ``context_parallel`` (cp > 1); the same on every kind of processes.
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


class Mode(str, enum.Enum):
    """What the wrapped model does (see the module docstring); the value is the name
    ``apply.wrap`` documents, so ``mode == "tensor_parallel"`` reads as it says."""

    SINGLE_DEVICE = "single_device"
    PIPELINE = "pipeline"
    PLACEMENT = "placement"
    DATA_PARALLEL = "data_parallel"
    TENSOR_PARALLEL = "tensor_parallel"
    CONTEXT_PARALLEL = "context_parallel"


@dataclass(frozen=True)
class ExecutionMode:
    """How a plan runs: ``mode`` on ``processes``.

    ``worker_tasks``: the worker tasks the plan's devices name, ascending (empty for a
    one-host plan).
    """

    mode: Mode
    processes: Processes
    worker_tasks: tuple[int, ...] = ()


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


def run_processes(plan: Plan) -> Processes:
    """Which processes run ``plan`` (no other check of the plan; ``apply.ensure_devices``
    sets them up)."""
    return _processes(plan_tasks(plan))


def _processes(tasks: dict[int, list[tuple[str, int]]]) -> Processes:
    return Processes.ONE_HOST if len(tasks) <= 1 else Processes.PER_WORKER


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
    processes = _processes(tasks)
    workers = tuple(sorted(tasks))
    # the mode of the plan's shape, whoever runs it: one process (one host), or one program
    # per worker
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
