"""Which of a plan's strategy dimensions ``apply`` runs, and the error for the others.

Pipeline position: ``apply.wrap`` calls ``check_applicable(plan, mode)`` right after the
mode is decided (``apply.mode``), before any model is built, so a plan with a dimension
no engine here runs is refused with what to change, never trained as something else
(a ZeRO-3 plan silently trained as ZeRO-1, say). ``apply.auto`` plans only what passes.

One rule per dimension, each naming the modes that run it; a dimension gains modes here
when an engine for it lands. Offload runs on one host (``apply.offload``).
"""
from __future__ import annotations

from typing import Any

from tfplan.apply.mode import Mode, Processes
from tfplan.core.errors import PlanMismatchError
from tfplan.planner.plan import Plan


def unapplied(plan: Plan, mode: Any = None) -> list[str]:
    """Each dimension of ``plan.strategy`` that ``apply`` cannot run (in ``mode``, an
    ``apply.mode.ExecutionMode``, where that matters), with why, as sentences."""
    s = plan.strategy
    out = unapplied_dimensions(s)
    if s.offload != "none" and mode is not None:
        out += _offload_mode_rule(s, mode)
    if s.cp > 1 and mode is not None and not out:
        out += _context_mode_rule(s, mode)
    return out


def unapplied_dimensions(s: Any) -> list[str]:
    """``unapplied`` for a strategy alone (a ``planner.plan.Strategy`` or a
    ``planner.candidates.Choice``: anything with ``zero_stage``, ``sequence_parallel``,
    ``cp`` and ``offload``); ``apply.auto`` hands ``not unapplied_dimensions(s)`` to the
    search as its ``admissible`` filter."""
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
    if s.cp > 1 and (s.tp, s.pp, s.zero_stage) != (1, 1, 0):
        out.append(f"cp={s.cp} (context parallelism) runs in apply on one host with "
                   f"data parallelism only (tp = pp = 1, zero_stage 0: "
                   "apply.context_parallel); this plan has "
                   f"tp={s.tp}, pp={s.pp}, zero_stage={s.zero_stage}")
    if s.offload != "none":
        out += _offload_rule(s)
    return out


def _offload_rule(s: Any) -> list[str]:
    """Offload (``apply.offload``): in the one-process modes whose optimizer updates
    ``apply`` places by hand (single device, pipeline, general placement, tensor-parallel
    copies; data parallel runs as copies there); not under a tf.distribute strategy
    (MultiWorkerMirroredStrategy places slots itself) or across workers
    (``_offload_mode_rule``); the weights too (``"optimizer+weights"``) only without
    tensor parallelism."""
    if s.offload not in ("optimizer", "optimizer+weights"):
        return [f"offload={s.offload!r} is not a known offload; expected 'none', "
                "'optimizer' or 'optimizer+weights'"]
    if s.offload == "optimizer+weights" and s.tp > 1:
        return [f"offload='optimizer+weights' with tp={s.tp}: apply builds each tensor "
                "shard on its rank, not on the host; offload='optimizer' runs with tp"]
    return []


def _offload_mode_rule(s: Any, mode: Any) -> list[str]:
    """Offload only where one process places every update (``_offload_rule``)."""
    from tfplan.apply.mode import Mode, Processes

    if mode.processes is not Processes.ONE_HOST or mode.mode in (Mode.MULTI_WORKER,
                                                                   Mode.MULTI_WORKER_HYBRID):
        return [f"offload={s.offload!r} runs on one host (one process places every "
                f"update); this plan runs as {mode.mode.value} on {mode.processes.value} "
                "processes"]
    return []


def check_applicable(plan: Plan, mode: Any = None) -> None:
    """PlanMismatchError naming every dimension of ``plan`` that ``apply`` cannot run."""
    problems = unapplied(plan, mode)
    if problems:
        raise PlanMismatchError(
            f"Plan {plan.name!r} cannot be applied: " + "; ".join(problems) + ". Re-plan "
            "without it (plan analyze --fix with the dimension off, e.g. --zero-stage 1, "
            "no --sequence-parallel, cp=1, --offload none), or price it only.")



def _context_mode_rule(s: Any, mode: Any) -> list[str]:
    """Mode ``context_parallel`` (``apply.context_parallel``) runs cp x dp on one host
    (the strategy-level rule, tp = pp = 1 and zero_stage 0, is ``unapplied_dimensions``')."""
    if _one_host(mode) and mode.mode is Mode.CONTEXT_PARALLEL:
        return []
    where = ("spans several worker processes" if not _one_host(mode) else
             f"runs as {mode.mode.value}")
    return [f"cp={s.cp} (context parallelism) runs on one host with data parallelism "
            f"(apply.context_parallel); this plan {where}"]


def _one_host(mode: Any) -> bool:
    return mode is None or mode.processes is Processes.ONE_HOST
