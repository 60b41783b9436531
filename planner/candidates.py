"""The hybrid strategy space: every dp x tp x pp strategy the search prices in closed form.

Pipeline position: called by ``planner.search`` (``hybrid_choices``) for every candidate
beyond the single-device, plain data-parallel and plain GPipe ones, and for a strategy
fixed with ``--fix``; each ``Choice`` is then priced by ``planner.pricing.Pricer``. Reads
only the ``SearchContext`` (device counts, layer count and types, global batch) and the
knobs; prices nothing.

A strategy (``Choice``): dp x tp x pp devices (tp dividing devices_per_node, pp at most
the layers, dp dividing the global batch), a micro-batch size (powers of two up to
MAX_MICROBATCH_SIZE; with pp = 1 also the whole local batch), a schedule (GPipe, 1F1B,
or interleaved 1F1B with v model chunks per device, Narayanan et al., SC'21, Sec.
2.2.2), activation recomputation (none, selective, full), ZeRO-1 on or off, and the
device layout (``planner.topology``: Megatron-LM's tp-dp-pp, and dp-outer tp-pp-dp where
it differs and keeps every replica in a node: ``dp_outer_differs``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tfplan.core.cluster import ClusterSpec
from tfplan.planner.context import SearchContext
from tfplan.planner.plan import DEFAULT_LAYOUT
from tfplan.profiler.comm import HEAD_SPLIT_TYPES

MAX_MICROBATCH_SIZE = 16  # micro-batch sizes tried: powers of two up to this
INTERLEAVE_CHOICES = (2, 3, 4)  # model chunks per device tried for the interleaved schedule


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


@dataclass(frozen=True)
class Choice:
    """One point of the strategy space."""

    dp: int
    tp: int
    pp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str = "none"  # "none" (pp == 1), "gpipe", "1f1b", "interleaved"
    recompute: str = "none"  # "none", "selective", "full"
    zero_stage: int = 0  # planner.plan.ZERO_STAGES
    virtual_stages: int = 1  # model chunks per pipeline device ("interleaved": > 1)
    layout: str = DEFAULT_LAYOUT  # planner.plan.LAYOUTS; "tp-pp-dp" shows as "dp-outer"
    sequence_parallel: bool = False  # tp > 1 only
    cp: int = 1  # context-parallel degree
    offload: str = "none"  # planner.plan.OFFLOAD

    @property
    def optimizer_sharding(self) -> bool:
        return self.zero_stage >= 1

    @property
    def replicas(self) -> int:
        """dp x cp: the ranks holding the same weights (planner.plan.Strategy.replicas)."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        parts = [f"dp={self.dp} tp={self.tp} pp={self.pp}"
                 + (f" cp={self.cp}" if self.cp > 1 else ""), f"mbs={self.microbatch_size}",
                 f"m={self.num_microbatches}"]
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.virtual_stages}"
                                          if self.virtual_stages > 1 else ""))
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.layout == "tp-pp-dp":
            parts.append("dp-outer")
        return "hybrid " + " ".join(parts)


def dp_outer_differs(cluster: ClusterSpec, dp: int, tp: int, pp: int) -> bool:
    """Whether the search also prices ``dp, tp, pp`` with the dp-outer layout (tp-pp-dp).

    The two layouts put stage s, replica r, rank t on s dp tp + r tp + t and on
    r tp pp + s tp + t: the same device for every (s, r, t) exactly when dp == 1 or
    pp == 1 (tp only scales both). When all dp tp pp devices lie in one node (the
    grid starts at device 0, so dp tp pp <= devices_per_node) every link is the
    intra-node one and the two are priced alike. Otherwise the grid spans nodes and
    they differ (Megatron's order sends across nodes or all-reduces with more members
    per node; dp-outer all-reduces across nodes). It is offered only when tp pp
    divides devices_per_node, so that every replica sits inside one node, which is
    what the layout is for."""
    per_node = cluster.devices_per_node
    return dp > 1 and pp > 1 and dp * tp * pp > per_node and per_node % (tp * pp) == 0



# --- the hybrid strategy space --------------------------------------------------------------

def hybrid_choices(ctx: SearchContext, knobs: Mapping[str, Any], *, skip_classic: bool,
                    shape: tuple[int, int, int] | None = None) -> list[Choice]:
    """Every dp x tp x pp factorization of the devices (tp a divisor of devices_per_node,
    pp <= layers, dp | global batch) x layout x micro-batch size x schedule x recompute x
    ZeRO-1, restricted by ``knobs``; ``shape`` fixes (dp, tp, pp) (then it need not use
    every device). ``skip_classic`` leaves out what the classic candidates already price.

    Layout: Megatron's tp-dp-pp, and also dp-outer tp-pp-dp where ``dp_outer_differs``.
    ``knobs["layout"]`` fixes it for every shape where the two put devices differently
    (dp > 1 and pp > 1); elsewhere they are the same plan, named tp-dp-pp."""
    cluster, b, layers = ctx.cluster, ctx.global_batch, len(ctx.names)
    n, per_node = cluster.num_devices, cluster.devices_per_node
    if shape is not None:
        shapes = [shape]
    else:
        shapes = [(n // (tp * pp), tp, pp) for tp in divisors(per_node)
                  for pp in divisors(n // tp) if pp <= layers]
    has_attention = any(l.type in HEAD_SPLIT_TYPES for l in ctx.profile.layers)
    out = []
    for dp, tp, pp in shapes:
        if b % dp:
            continue
        local = b // dp
        # pp == 1: the whole local batch at once, or gradient accumulation over
        # micro-batches of up to MAX_MICROBATCH_SIZE samples (less activation memory)
        sizes = sorted({2**k for k in range(MAX_MICROBATCH_SIZE.bit_length())
                        if 2**k <= MAX_MICROBATCH_SIZE and local % 2**k == 0}
                       | ({local} if pp == 1 else set()))
        if "microbatch_size" in knobs:
            sizes = [knobs["microbatch_size"]]
        if dp > 1 and pp > 1 and "layout" in knobs:
            layouts: tuple[str, ...] = (knobs["layout"],)
        else:
            layouts = (DEFAULT_LAYOUT,) + (("tp-pp-dp",) if "layout" not in knobs and
                                           dp_outer_differs(cluster, dp, tp, pp) else ())
        for mbs in sizes:
            if local % mbs:
                continue
            m = local // mbs
            schedules = ("none",) if pp == 1 else ("1f1b", "gpipe", "interleaved")
            if "schedule" in knobs and pp > 1:
                schedules = (knobs["schedule"],)
            elif ctx.batch_barrier and pp > 1 and m > 1:  # planner.batch_stats
                schedules = ("gpipe",)
            for schedule, v in with_virtual_stages(schedules, knobs, pp, m, layers):
                for rc in ((knobs["recompute"],) if "recompute" in knobs
                           else ("none", "selective", "full") if has_attention
                           else ("none", "full")):
                    for zero in ((knobs["zero_stage"],) if "zero_stage" in knobs
                                 else ((0, 1) if dp > 1 else (0,))):
                        classic = tp == 1 and rc == "none" and not zero and (
                            (pp == 1 and m == 1) or (dp == 1 and schedule == "gpipe"))
                        if skip_classic and classic:
                            continue
                        out += [Choice(dp, tp, pp, mbs, m, schedule, rc, int(zero), v, layout)
                                for layout in layouts]
    return out


def with_virtual_stages(schedules: tuple[str, ...], knobs: Mapping[str, Any], pp: int,
                         m: int, layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs: v = 1 for GPipe and 1F1B; for the interleaved
    schedule v in INTERLEAVE_CHOICES (or the fixed ``virtual_stages``), where Megatron-LM
    allows it: m a multiple of pp (Narayanan et al., SC'21, Sec. 2.2.2) and at least two
    layers per chunk."""
    out = []
    for schedule in schedules:
        if schedule != "interleaved":
            out.append((schedule, 1))
            continue
        vs = (knobs["virtual_stages"],) if "virtual_stages" in knobs else INTERLEAVE_CHOICES
        out += [(schedule, v) for v in vs
                if v > 1 and m % pp == 0 and 2 * pp * v <= layers]
    return out
