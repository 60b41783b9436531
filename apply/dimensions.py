"""Which of a plan's strategy dimensions ``apply`` runs, and the error for the others.

Pipeline position: ``apply.wrap`` calls ``check_applicable(plan, mode)`` right after the
mode is decided (``apply.mode``), before any model is built, so a plan with a dimension
no engine here runs is refused with what to change, never trained as something else
(a ZeRO-3 plan silently trained as ZeRO-1, say). ``apply.auto`` plans only what passes.

One rule per dimension, each naming the modes that run it; a dimension gains modes here
when an engine for it lands. ZeRO-2 and ZeRO-3 (``zero_stage`` 2 and 3) run on one host and
through worker 0 (``apply.zero``, ``apply.zero3``); with one program per worker ZeRO-2
runs (``apply.zero_workers``), ZeRO-3 not yet.
"""
from __future__ import annotations

from typing import Any

from tfplan.apply.mode import Processes, run_processes
from tfplan.core.errors import PlanMismatchError
from tfplan.planner.plan import Plan


def unapplied(plan: Plan, mode: Any = None) -> list[str]:
    """Each dimension of ``plan.strategy`` that ``apply`` cannot run (in ``mode``, an
    ``apply.mode.ExecutionMode``, where that matters), with why, as sentences."""
    s = plan.strategy
    out = []
    zero = _zero_rule(plan, mode)
    if zero:
        out.append(zero)
    if s.sequence_parallel:
        out.append("sequence_parallel has no engine in apply yet")
    if s.cp > 1:
        out.append(f"cp={s.cp} (context parallelism) has no engine in apply yet")
    if s.offload != "none":
        out.append(f"offload={s.offload!r} has no engine in apply yet")
    return out


def _zero_rule(plan: Plan, mode: Any) -> str | None:
    """ZeRO-2 and ZeRO-3 run where one process drives the replicas' devices: one host, or
    worker 0 driving every worker's (``apply.remote``), with ``apply.zero`` and
    ``apply.zero3`` on ``apply.tensor_parallel``'s replicas (dp = 1: nothing to shard);
    ZeRO-2 also with one program per worker (``apply.zero_workers``). ZeRO-3 with one
    program per worker does not run yet."""
    s = plan.strategy
    if s.zero_stage < 2:
        return None
    what = f"zero_stage={s.zero_stage} (gradients{' and weights' if s.zero_stage == 3 else ''}" \
           " sharded over the data-parallel ranks)"
    processes = mode.processes if mode is not None else run_processes(plan)
    if processes is Processes.PER_WORKER and s.zero_stage == 3:
        return (f"{what} does not run across worker processes with one program per "
                "worker yet (there apply runs zero_stage 0, 1 and 2: apply.zero_workers); "
                "it runs on one host, or with worker 0 driving every worker's devices "
                "(apply.remote)")
    return None


def check_applicable(plan: Plan, mode: Any = None) -> None:
    """PlanMismatchError naming every dimension of ``plan`` that ``apply`` cannot run."""
    problems = unapplied(plan, mode)
    if problems:
        raise PlanMismatchError(
            f"Plan {plan.name!r} cannot be applied: " + "; ".join(problems) + ". Re-plan "
            "without it (plan analyze --fix with the dimension off, e.g. --zero-stage 1, "
            "no --sequence-parallel, cp=1, --offload none), or price it only.")
