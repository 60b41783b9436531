"""Each pipeline device's order of forward and backward passes (GPipe, 1F1B, interleaved
1F1B), as pure Python: no TensorFlow.

Pipeline position: ``apply.schedule`` enforces these orders in a traced train step, and
``reports.images`` draws them. Model chunk (stage) ``k`` of ``plan.stages`` runs on
pipeline device ``k % pp`` (``planner.plan``: interleaved plans have ``pp * v`` stages,
v = ``virtual_stages``; other plans v = 1). ``device_order`` lists device ``d``'s
slots: forwards in the order micro-batch groups of ``pp`` x chunks x micro-batches of
the group, backwards the same with the chunks reversed, ``w`` warm-up forwards first,
then one forward / one backward, then the remaining backwards:

* GPipe (Huang et al., NeurIPS 2019): w = all forwards;
* 1F1B / PipeDream-Flush (Narayanan et al., SC'21, Sec. 2.2.1): w = pp - d - 1;
* interleaved 1F1B (Sec. 2.2.2; Megatron-LM's
  ``forward_backward_pipelining_with_interleaving``): w = 2 (pp - d - 1) + (v - 1) pp,
  at most m v (m micro-batches).
"""
from __future__ import annotations

from dataclasses import dataclass

from tfplan.core.errors import PlannerError


@dataclass(frozen=True)
class Slot:
    """One forward ("F") or backward ("B") pass of one micro-batch on one model chunk."""

    kind: str
    microbatch: int
    stage: int  # index in plan.stages (model chunk); runs on device stage % pp


def device_order(kind: str, device: int, pp: int, virtual_stages: int,
                 num_microbatches: int) -> tuple[Slot, ...]:
    """Device ``device``'s forward and backward slots, in the schedule's order."""
    m, v, p = num_microbatches, virtual_stages, pp
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    forwards = [Slot("F", j, c * p + device) for g in groups for c in range(v) for j in g]
    backwards = [Slot("B", j, c * p + device)
                 for g in groups for c in reversed(range(v)) for j in g]
    if kind == "gpipe":
        warm = m * v
    elif kind == "1f1b":
        warm = min(p - device - 1, m * v)
    elif kind == "interleaved":
        warm = min(2 * (p - device - 1) + (v - 1) * p, m * v)
    else:
        raise PlannerError(f"Pipeline schedule {kind!r} is unknown; expected gpipe, 1f1b or "
                           "interleaved. Regenerate the plan.")
    order = forwards[:warm]
    for i, backward in enumerate(backwards):
        if warm + i < len(forwards):
            order.append(forwards[warm + i])
        order.append(backward)
    return tuple(order)
