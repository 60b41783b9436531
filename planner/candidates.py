"""The hybrid strategy space: every dp x tp x pp strategy the search prices in closed form.

Pipeline position: called by ``planner.search`` (``hybrid_choices``) for every candidate
beyond the single-device, plain data-parallel and plain GPipe ones, and for a strategy
fixed with ``--fix``; each ``Choice`` is then priced by ``planner.pricing.Pricer``. Reads
only the ``SearchContext`` (device counts, layer count and types, global batch) and the
knobs; prices nothing.

A strategy (``Choice``): dp x cp x tp x pp devices (tp dividing devices_per_node, cp a
context-parallel degree (``cp_degrees``), pp at most the layers, dp dividing the global
batch), a micro-batch size (divisors of the local batch; ``hybrid_choices``), a schedule
(GPipe, 1F1B, or interleaved 1F1B with v model chunks per device, Narayanan et al., SC'21,
Sec. 2.2.2), activation recomputation (none, selective, full), the ZeRO stage, sequence
parallelism, offloading, the expert-parallel degree ep (models with mixture-of-experts
layers: ``expert_parallel_degrees``), and the device layout (``planner.topology``:
Megatron-LM's tp-dp-pp, and dp-outer tp-pp-dp where it differs and keeps every replica in a
node: ``dp_outer_differs``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tfplan.core.cluster import ClusterSpec
from tfplan.planner.context import SearchContext
from tfplan.planner.experts import expert_degrees
from tfplan.planner.plan import DEFAULT_LAYOUT
from tfplan.planner.sequence import (SEQUENCE_LOCAL_TYPES, has_sequence, sequence_length,
                                     sequence_splits)
from tfplan.profiler.comm import HEAD_SPLIT_TYPES

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
    ep: int = 1  # expert-parallel degree (planner.experts): divides dp and every layer's E

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
                 + (f" cp={self.cp}" if self.cp > 1 else "")
                 + (f" ep={self.ep}" if self.ep > 1 else ""), f"mbs={self.microbatch_size}",
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
                    shape: tuple[int, ...] | None = None,
                    offloads: tuple[str, ...] = ("none",), savers_on: bool = False
                    ) -> list[Choice]:
    """Every dp x cp x tp x pp factorization of the devices (tp a divisor of
    devices_per_node, cp a context-parallel degree the model allows: ``cp_degrees``, pp <=
    layers, dp | global batch) x layout x micro-batch size x schedule x recompute x ZeRO
    stage x sequence parallelism x offload, restricted by ``knobs``; ``shape`` fixes
    (dp, tp, pp) or (dp, tp, pp, cp) (then it need not use every device, and tp may span
    nodes). ``skip_classic`` leaves out what the classic candidates already price.
    ``offloads``: the offload settings tried (the search adds the offloaded ones for a
    shape where nothing else fits). ``savers_on``: only the variants with every other
    memory saver on (full recomputation, the highest ZeRO stage, sequence parallelism)
    where no knob names them -- what the search prices offloading with.

    Micro-batch sizes: every divisor of the local batch (global batch / dp); with pp = 1
    the whole local batch is one step and smaller ones are gradient accumulation; with
    pp > 1 those that give at least pp micro-batches (fewer leave every device idle over
    half the step: bubble (pp-1)/(m+pp-1)), and the SMALL_MICROBATCH_SIZES.
    ZeRO stages 2 and 3 only with pp = 1, as DeepSpeed allows (a pipeline's micro-batches
    would gather the weights once each); a fixed shape may still ask for them.
    Sequence parallelism only with tp > 1, both with and without.
    Layout: Megatron's tp-dp-pp, and also dp-outer tp-pp-dp where ``dp_outer_differs``.
    ``knobs["layout"]`` fixes it for every shape where the two put devices differently
    (dp > 1 and pp > 1); elsewhere they are the same plan, named tp-dp-pp."""
    # pp x v stages cut between units (a block counts as one: graph.pipeline_units)
    cluster, b, layers = ctx.cluster, ctx.global_batch, len(ctx.pipeline_units)
    n, per_node = cluster.num_devices, cluster.devices_per_node
    if shape is not None:
        shapes = [tuple(shape) + (1,) * (4 - len(shape))]
    else:
        shapes = [(n // (tp * pp * cp), tp, pp, cp) for tp in divisors(per_node)
                  for cp in cp_degrees(ctx, per_node // tp, knobs)
                  for pp in divisors(n // (tp * cp)) if pp <= layers]
    has_attention = any(l.kind in HEAD_SPLIT_TYPES for l in ctx.profile.layers)
    # not inside blocks: their own code between sub-layers runs on whole sequences
    has_sequence_layers = not ctx.units and any(
        l.kind in SEQUENCE_LOCAL_TYPES and has_sequence(l) for l in ctx.profile.layers)
    out = []
    for dp, tp, pp, cp in shapes:
        if b % dp:
            continue
        local = b // dp
        sizes = divisors(local)
        if pp > 1:  # fewer micro-batches than stages idle every device over half the step
            sizes = [s for s in sizes if local // s >= pp or s in SMALL_MICROBATCH_SIZES]
        if "microbatch_size" in knobs:
            sizes = [knobs["microbatch_size"]]
        if dp * cp > 1 and pp > 1 and "layout" in knobs:
            layouts: tuple[str, ...] = (knobs["layout"],)
        else:
            layouts = (DEFAULT_LAYOUT,) + (("tp-pp-dp",) if "layout" not in knobs and
                                           dp_outer_differs(cluster, dp * cp, tp, pp) else ())
        zeros = (knobs["zero_stage"],) if "zero_stage" in knobs else \
            (0,) if dp * cp == 1 else (0, 1, 2, 3) if pp == 1 else (0, 1)
        sps = (knobs["sequence_parallel"],) if "sequence_parallel" in knobs else \
            (False, True) if tp > 1 and has_sequence_layers and \
            sequence_splits(ctx.profile, tp) else (False,)
        recomputes = (knobs["recompute"],) if "recompute" in knobs else \
            ("none", "selective", "full") if has_attention else ("none", "full")
        offload_options = (knobs["offload"],) if "offload" in knobs else offloads
        eps = expert_parallel_degrees(ctx, dp, knobs)
        if savers_on:
            recomputes = recomputes if "recompute" in knobs else ("full",)
            zeros = zeros if "zero_stage" in knobs else (max(zeros),)
            sps = sps if "sequence_parallel" in knobs else (max(sps),)
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
                for rc in recomputes:
                    for zero in zeros:
                        classic = tp == 1 and cp == 1 and rc == "none" and not zero and (
                            (pp == 1 and m == 1) or (dp == 1 and schedule == "gpipe"))
                        if skip_classic and classic and offload_options == ("none",) \
                                and eps == [1]:
                            continue
                        out += [Choice(dp, tp, pp, mbs, m, schedule, rc, int(zero), v, layout,
                                       sp, cp, offload, ep)
                                for layout in layouts for sp in sps
                                for offload in offload_options for ep in eps
                                if not (skip_classic and classic and offload == "none"
                                        and ep == 1)]
    return out


# With pp > 1, micro-batch sizes that leave fewer micro-batches than stages are tried only
# among these (a small model's per-micro-batch overhead can still make them the fastest)
SMALL_MICROBATCH_SIZES = (1, 2, 4, 8, 16)

# Below this many tokens per sample context parallelism is not searched (a fixed cp is
# still priced): our choice -- the activations it divides are then small next to the
# weights' state, and every attention layer pays a key/value exchange.
CP_MIN_SEQUENCE = 8192
MAX_CP = 8  # context-parallel degrees searched: up to one node's worth


def cp_degrees(ctx: SearchContext, room: int, knobs: Mapping[str, Any]) -> list[int]:
    """Context-parallel degrees to search next to tp (``room`` = devices_per_node / tp):
    1, and for a model with attention over at least CP_MIN_SEQUENCE tokens every divisor
    of ``room`` up to MAX_CP that splits the sequence into 2 cp equal chunks (Megatron-
    Core balances the causal mask so)."""
    if "cp" in knobs:
        return [knobs["cp"]] if room % knobs["cp"] == 0 else []
    seq = sequence_length(ctx.profile)
    if not seq or seq < CP_MIN_SEQUENCE or ctx.units:  # blocks: see search._fixed
        return [1]
    return [c for c in divisors(room) if c <= MAX_CP and seq % (2 * c) == 0] or [1]


def expert_parallel_degrees(ctx: SearchContext, dp: int, knobs: Mapping[str, Any]
                            ) -> list[int]:
    """Expert-parallel degrees to search at data-parallel degree ``dp``: every divisor of dp
    that divides each mixture-of-experts layer's E (``experts.expert_degrees``; [1] for a
    model without them), or the fixed ``ep`` where dp allows it."""
    allowed = expert_degrees(ctx.profile, dp)
    if "ep" in knobs:
        return [knobs["ep"]] if knobs["ep"] in allowed else []
    return allowed


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
