"""Which of a plan's strategy dimensions ``apply`` runs, and the error for the others.

Pipeline position: ``apply.wrap`` calls ``check_applicable(plan, mode)`` right after the
mode is decided (``apply.mode``), before any model is built, so a plan with a dimension
no engine here runs is refused with what to change, never trained as something else
(a ZeRO-3 plan silently trained as ZeRO-1, say). ``apply.auto`` plans only what passes.

One rule per dimension, each naming the modes that run it; a dimension gains modes here
when an engine for it lands.
"""
from __future__ import annotations

from typing import Any

from tfplan.core.errors import PlanMismatchError
from tfplan.planner.plan import Plan


def unapplied(plan: Plan, mode: Any = None) -> list[str]:
    """Each dimension of ``plan.strategy`` that ``apply`` cannot run (in ``mode``, an
    ``apply.mode.ExecutionMode``, where that matters), with why, as sentences."""
    s = plan.strategy
    out = []
    if s.zero_stage >= 2:
        out.append(f"zero_stage={s.zero_stage} (gradients{' and weights' if s.zero_stage == 3 else ''}"
                   " sharded over the data-parallel ranks) has no engine in apply yet; "
                   "zero_stage 0 and 1 run")
    # sequence parallelism runs inside the tensor-parallel engine (apply.sequence_parallel),
    # which every plan with tp > 1 uses (one host, or each worker's part)
    if s.sequence_parallel and s.tp == 1:
        out.append("sequence_parallel=True with tp=1 (it cuts the sequence over a "
                   "tensor-parallel group; there is none) runs only with tp > 1")
    if s.cp > 1:
        out.append(f"cp={s.cp} (context parallelism) has no engine in apply yet")
    if s.offload != "none":
        out.append(f"offload={s.offload!r} has no engine in apply yet")
    return out


def check_applicable(plan: Plan, mode: Any = None) -> None:
    """PlanMismatchError naming every dimension of ``plan`` that ``apply`` cannot run."""
    problems = unapplied(plan, mode)
    if problems:
        raise PlanMismatchError(
            f"Plan {plan.name!r} cannot be applied: " + "; ".join(problems) + ". Re-plan "
            "without it (plan analyze --fix with the dimension off, e.g. --zero-stage 1, "
            "no --sequence-parallel, cp=1, --offload none), or price it only.")
