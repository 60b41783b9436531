"""Strategy search: price every candidate strategy, rank them, choose one and say why.

Pipeline position: reads a ModelProfile and a ClusterSpec (as a
``planner.context.SearchContext``), prices candidates with ``planner.cost_model`` and
``planner.collectives``, places pipeline stages with ``planner.pipeline_ilp``,
checks every plan with ``planner.validate``, and returns a ``SearchResult`` that
the CLI renders and writes as plan.json.

Candidates in this first cut:

- single device (dp = tp = pp = 1);
- data parallel over all devices, and over every smaller power of two, when dp
  divides the global batch. Step = compute of the local batch + the exposed part
  of the gradient all-reduce over devices 0..dp-1 (``collectives.group_allreduce_time_s``:
  a ring in a node, hierarchical over whole nodes, else a flat ring over the
  inter-node link; it overlaps the backward pass of every layer but the first:
  ``cost_model.exposed_allreduce_s``) + the optimizer update;
- GPipe pipelines of pp = 2..min(devices, layers) stages, one device each (when
  there are more than 16 such degrees: the powers of two and the largest), the
  split chosen by ``pipeline_ilp.best_split`` (the ILP, bounded by an exact DP;
  the DP alone above ILP_MAX_BINARIES), the number of micro-batches m among the
  divisors of the global batch in [pp, 8 pp] by predicted step time.
  Step = (m + pp - 1) x slowest stage per micro-batch + optimizer. GPipe keeps
  every micro-batch's activations until its backward pass, so memory does not
  depend on m;
- hybrids (``planner.candidates``, priced by ``planner.pricing``): every dp x cp x tp x
  pp factorization of all the devices (tp dividing devices_per_node, cp where the
  sequence is long, pp <= layers), micro-batch sizes (divisors of the local batch), GPipe,
  1F1B or interleaved, recomputation none/selective (the attention core)/full, ZeRO
  stages 0-3 (2 and 3 without pipelines), sequence parallelism on/off (tp > 1), on
  Megatron-LM's device layout (tp-dp-pp) and, on several nodes, also dp outermost
  (tp-pp-dp, "dp-outer": each replica's pipeline inside one node;
  ``candidates.dp_outer_differs``), priced in closed form; for a shape where none of
  them fits, the offloaded variants with every saver on (``_offloaded``). The
  KEEP_PER_SHAPE fastest that fit per (dp, tp, pp, layout) are kept and the MAX_RANKED
  fastest fitting candidates listed.

Models with mixture-of-experts layers: every hybrid also at each expert-parallel degree ep
dividing dp and every layer's expert count (``candidates.expert_parallel_degrees``, priced
as ``planner.experts`` says); the reason then says why the chosen ep (``_expert_reason``).

Knobs (``fix`` without a shape; ``plan analyze --schedule``, ``--zero-stage``, ...)
restrict only what they name: the classic candidates stay when they agree with every
knob (``_classic_allowed``, ``_matches``); with a shape they fix one strategy, which is
priced even when it does not fit (and tp may then span nodes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import InfeasiblePlanError, PlannerError, SolverError
from tfplan.core.units import fmt_bytes, fmt_seconds
from tfplan.planner import collectives as coll
from tfplan.planner import cost_model as cm
from tfplan.planner.batch_stats import with_batch_norm
from tfplan.planner.candidates import Choice, divisors, hybrid_choices
from tfplan.planner.context import SearchContext, search_context
from tfplan.planner.experts import (ALL_TO_ALLS_PER_LAYER, check_expert_degree, expert_share,
                                    moe_layers)
from tfplan.planner.pipeline_ilp import (Split, SplitProblem, Transfer, best_split,
                                         min_max_stage_memory, min_stages_to_fit)
from tfplan.planner.placement_search import placement_plans
from tfplan.planner.sequence import sequence_length, sequence_splits
from tfplan.planner.plan import LAYOUTS, OFFLOAD, RECOMPUTE, ZERO_STAGES, Breakdown, Plan, Stage, Strategy
from tfplan.planner.pricing import Estimate, Pricer, best_per_shape
from tfplan.planner.topology import link_between
from tfplan.planner.validate import validate_plan
from tfplan.profiler.model_profile import ModelProfile

MAX_MICROBATCHES_PER_STAGE = 8  # m <= 8 pp: past that the bubble is < 1/9 of the step
MAX_PIPELINE_DEGREES = 16  # above this many pp values: powers of two and the largest only
SHAPE_KEYS = ("dp", "tp", "pp", "cp", "num_microbatches")
KNOB_KEYS = ("microbatch_size", "recompute", "schedule", "zero_stage", "optimizer_sharding",
             "sequence_parallel", "offload", "virtual_stages", "layout", "ep")
FIX_KEYS = SHAPE_KEYS + KNOB_KEYS
MAX_RANKED = 20  # fitting candidates listed (the chosen one first)
# A simple plan (``_is_simple``) within 3% of the fastest is chosen over it: the cost
# model's error is larger than that, and simple plans are the ones ``apply`` runs.
SIMPLICITY_TOLERANCE = 0.03


@dataclass(frozen=True)
class SearchResult:
    chosen: Plan  # candidates[0] when it fits; carries the ``reason``
    candidates: tuple[Plan, ...]  # fitting ones by step time, then the ones that do not fit
    evaluated: int = 0  # strategies priced to find them


def search(profile: ModelProfile, cluster: ClusterSpec, global_batch: int, *,
           fix: Mapping[str, int] | None = None, time_limit_s: float = 10.0,
           batch_norm: str = "global",
           admissible: Callable[[Choice], bool] | None = None) -> SearchResult:
    """Rank the candidate strategies for training ``profile`` on ``cluster``.

    ``fix`` (e.g. ``{"dp": 4}`` or ``{"pp": 2, "num_microbatches": 4}``) prices only
    that strategy and returns it even when it does not fit. ``time_limit_s`` is the
    ILP budget for the whole search, shared evenly among the pipeline splits.
    ``batch_norm``: every plan's rule for BatchNormalization statistics, priced
    (``planner.batch_stats``). ``admissible``: only hybrid strategies it accepts are
    priced (``apply.auto`` passes what ``apply`` can run; the classic candidates use no
    dimension beyond dp and pp). Same input, same output. Raises InfeasiblePlanError when
    nothing fits.
    """
    ctx = search_context(profile, cluster, global_batch, batch_norm)
    knobs = _check_fix(fix) if fix is not None else {}
    if "ep" in knobs:  # a dp to divide: the fixed one, else ep itself (any dp it divides)
        check_expert_degree(profile, knobs["ep"], knobs.get("dp", knobs["ep"]))
    if ctx.batch_barrier and knobs.get("schedule") in ("1f1b", "interleaved") and \
            knobs.get("num_microbatches", 2) > 1:
        raise PlannerError(
            f"--schedule {knobs['schedule']} cannot run with global batch statistics: model "
            f"{profile.model_name!r} has BatchNormalization layers, and each needs every "
            "micro-batch before any continues, which 1F1B's order would wait on forever. Use "
            "--schedule gpipe, or --batch-norm local (per micro-batch statistics, as GPipe).")
    if any(k in knobs for k in SHAPE_KEYS):
        return _fixed(ctx, knobs, time_limit_s)
    if "microbatch_size" in knobs:
        check_microbatch_size(knobs["microbatch_size"], global_batch)
    n, b = cluster.num_devices, global_batch
    plans: list[Plan] = []
    if _classic_allowed(knobs):  # the classic candidates, unless a knob excludes them all
        plans = [_data_parallel(ctx, 1)]
        plans += [_data_parallel(ctx, dp) for dp in _data_parallel_degrees(n) if b % dp == 0]
        # plain pipelines (one device per stage, no dp) within one node; across nodes the
        # hybrids cover pipelines, with every device busy
        pipelines = [(pp, _microbatch_choices(b, pp))
                     for pp in _pipeline_degrees(n if cluster.num_nodes == 1
                                                 else cluster.devices_per_node,
                                                 len(ctx.pipeline_units))]
        pipelines = [(pp, ms) for pp, ms in pipelines if ms]
        per_ilp_s = time_limit_s / max(1, sum(len(ms) for _, ms in pipelines))
        plans += [_pipeline(ctx, pp, ms, per_ilp_s) for pp, ms in pipelines]
        plans += placement_plans(ctx, time_limit_s)  # branchy graphs, one node, <= 4 devices
        plans = [p for p in plans if _matches(p.strategy, knobs)]
    evaluated = len(plans)
    pricer = Pricer(ctx)
    # a tensor-parallel degree at which no layer is worth splitting only idles devices
    estimates = [pricer.estimate(c) for c in hybrid_choices(ctx, knobs,
                                                            skip_classic=_classic_allowed(knobs))
                 if (c.tp == 1 or any(pricer.splits_for(c.tp)))
                 and (admissible is None or admissible(c))]
    estimates += _offloaded(ctx, pricer, knobs, estimates, admissible)
    evaluated += len(estimates)
    plans += [pricer.to_plan(e) for e in best_per_shape(estimates, cluster.device.memory_bytes)]
    plans = [with_batch_norm(plan, profile, batch_norm) for plan in plans]
    for plan in plans:
        validate_plan(plan, profile, error_type=SolverError)
    ranked = sorted(plans, key=_rank_key)
    if not ranked:  # only knobs restrict the search this far
        raise PlannerError(_nothing_to_price(ctx, knobs))
    if not ranked[0].predicted.fits:
        raise InfeasiblePlanError(_nothing_fits(ctx, ranked, estimates))
    fitting = [p for p in ranked if p.predicted.fits][:MAX_RANKED]
    not_fitting = [p for p in ranked if not p.predicted.fits]
    not_fitting = [p for p in not_fitting if p.strategy.tp == 1 and p.strategy.recompute == "none"
                   and not p.strategy.optimizer_sharding and "hybrid" not in p.name] \
        + [p for p in not_fitting if "hybrid" in p.name][:5]
    simple = [p for p in fitting if _is_simple(p)]
    if simple and simple[0] is not fitting[0] and \
            simple[0].predicted.step_time_s <= (1 + SIMPLICITY_TOLERANCE) * fitting[0].predicted.step_time_s:
        fitting.remove(simple[0])
        fitting.insert(0, simple[0])
    ranked = fitting + sorted(not_fitting, key=_rank_key)
    listed = f"the {len(fitting)} fastest that fit are listed"
    if not_fitting:
        listed += f", and apart from them {len(not_fitting)} that do not fit"
    chosen = ranked[0].with_reason(_reason(ranked) + _expert_reason(ranked[0], plans, profile)
                                   + f" {evaluated} strategies were priced; {listed}.")
    return SearchResult(chosen=chosen, candidates=(chosen, *ranked[1:]), evaluated=evaluated)


def _classic_allowed(knobs: Mapping[str, Any]) -> bool:
    """Whether the classic candidates (single device, plain data parallel, plain GPipe,
    general placement) can satisfy ``knobs`` at all: they have no recomputation, no
    ZeRO, no sequence parallelism, no offloading, and their own micro-batch counts, so
    knobs that name anything else leave them out (``_matches`` filters the rest)."""
    return knobs.get("recompute", "none") == "none" and not knobs.get("zero_stage") \
        and not knobs.get("sequence_parallel") and knobs.get("offload", "none") == "none" \
        and knobs.get("schedule", "gpipe") == "gpipe" and "virtual_stages" not in knobs \
        and knobs.get("ep", 1) == 1


def _matches(s: Strategy, knobs: Mapping[str, Any]) -> bool:
    """Whether a classic plan's strategy agrees with every knob that applies to it (a
    schedule or layout knob names pipelines only, so it does not drop a data-parallel
    plan, as it does not drop the pp = 1 hybrids)."""
    if "microbatch_size" in knobs and s.microbatch_size != knobs["microbatch_size"]:
        return False
    if "layout" in knobs and s.dp > 1 and s.pp > 1 and s.layout != knobs["layout"]:
        return False
    return True


def _offloaded(ctx: SearchContext, pricer: Pricer, knobs: Mapping[str, Any],
               estimates: list[Estimate],
               admissible: Callable[[Choice], bool] | None = None) -> list[Estimate]:
    """Offloaded variants (``Strategy.offload``) of every (dp, tp, pp, cp) shape where
    nothing without offloading fits: offloading costs host-link time every step, so it
    is how a model trains on too few devices at all, not a speed-up (ZeRO-Offload, Ren et
    al., ATC'21, Sec. 1). Skipped when a knob fixes ``offload``."""
    if "offload" in knobs:
        return []
    cap = ctx.cluster.device.memory_bytes
    shapes: dict[tuple[int, ...], bool] = {}
    for e in estimates:
        key = (e.choice.dp, e.choice.tp, e.choice.pp, e.choice.cp)
        shapes[key] = shapes.get(key, False) or e.fits(cap)
    out = []
    for shape, fits in shapes.items():
        if not fits:
            out += [pricer.estimate(c) for c in hybrid_choices(
                ctx, knobs, skip_classic=False, shape=shape,
                offloads=("optimizer", "optimizer+weights"), savers_on=True)
                if admissible is None or admissible(c)]
    return out


def _is_simple(p: Plan) -> bool:
    """No tensor parallelism, no dp x pp hybrid, no recomputation, no ZeRO-1, no expert
    parallelism: what ``apply.wrap`` runs with the fewest moving parts."""
    s = p.strategy
    return s.tp == 1 and (s.dp == 1 or s.pp == 1) and s.recompute == "none" \
        and not s.optimizer_sharding and s.cp == 1 and s.offload == "none" and s.ep == 1


def _rank_key(p: Plan):
    return (not p.predicted.fits, p.predicted.step_time_s, p.strategy.num_devices, p.name)


# --- inputs -----------------------------------------------------------------------------------

def _data_parallel_degrees(num_devices: int) -> list[int]:
    powers = [2**k for k in range(1, num_devices.bit_length()) if 2**k < num_devices]
    return powers + ([num_devices] if num_devices > 1 else [])


def _pipeline_degrees(num_devices: int, num_layers: int) -> list[int]:
    top = min(num_devices, num_layers)
    if top - 1 <= MAX_PIPELINE_DEGREES:
        return list(range(2, top + 1))
    return sorted({2**k for k in range(1, top.bit_length()) if 2**k <= top} | {top})


def _microbatch_choices(global_batch: int, pp: int) -> list[int]:
    counts = divisors(global_batch)
    inside = [d for d in counts if pp <= d <= MAX_MICROBATCHES_PER_STAGE * pp]
    return inside or [d for d in counts if d >= pp][:1]


# --- pricing one strategy -------------------------------------------------------------------

def _data_parallel(ctx: SearchContext, dp: int) -> Plan:
    p, cluster, device = ctx.profile, ctx.cluster, ctx.cluster.device
    local = ctx.global_batch // dp
    grad_bytes = sum(l.grad_bytes for l in p.layers)
    first = ctx.names[0]
    overlappable_s = sum(cm.layer_fwd_bwd_time_s(l, local, p.batch_size, device, p.precision,
                                                 measured_batch_size=p.measured_batch_size)[1]
                         for l in p.layers if l.name != first)
    breakdown = Breakdown(
        compute_s=sum(ctx.layer_times_s(local)),
        communication_s=cm.exposed_allreduce_s(coll.group_allreduce_time_s(grad_bytes, range(dp),
                                                                              cluster),
                                               overlappable_s),
        bubble_s=0.0, recompute_s=0.0,
        optimizer_s=cm.optimizer_time_s(p.param_bytes, grad_bytes,
                                        sum(l.optimizer_bytes for l in p.layers), device))
    breakdown = cm.with_shared_cores(
        breakdown, [breakdown.compute_s + breakdown.optimizer_s] * dp, cluster)
    devices = cluster.device_names()[:dp]
    memory = math.ceil(sum(ctx.layer_memories_bytes(local)))
    return ctx.plan("single device" if dp == 1 else f"data parallel dp={dp}",
                    Strategy(dp=dp, tp=1, pp=1, microbatch_size=local, num_microbatches=1),
                    (Stage(layers=ctx.names, devices=devices),), breakdown,
                    tuple((d, memory) for d in devices),
                    "closed form (one stage; every layer on each data-parallel device)")


def _split_problem(ctx: SearchContext, pp: int, microbatch_size: int, samples_in_flight: int,
                  memory_capacity_bytes: float | None) -> SplitProblem:
    """The pipeline-split problem for pp stages (GPipe: every micro-batch in flight).

    A boundary tensor is sent forward and its gradient sent back:
    2 x p2p_time_s(bytes for one micro-batch) per boundary it crosses. The problem's
    items are the pipeline units (``SearchContext.pipeline_units``: a block whole, or one
    layer); ``SearchContext.unit_bounds`` turns its stages back into layer ranges.
    """
    b = ctx.profile.batch_size
    units = ctx.pipeline_units
    unit_of = [k for k, (start, stop) in enumerate(units) for _ in range(start, stop)]
    links = [link_between(ctx.cluster, s, s + 1) for s in range(pp - 1)]
    transfers = tuple(Transfer(
        src=unit_of[src], dsts=tuple(sorted({unit_of[d] for d in dsts})),
        send_time_s=tuple(2 * coll.p2p_time_s(cm.scaled(nbytes, microbatch_size, b), link)
                          for link in links),
        recv_memory_bytes=cm.with_margin_bytes(cm.scaled(nbytes, samples_in_flight, b)))
        for src, dsts, nbytes in ctx.tensors)
    times, memories = ctx.layer_times_s(microbatch_size), ctx.layer_memories_bytes(
        samples_in_flight)
    return SplitProblem(
        layer_names=tuple(ctx.names[start] for start, _ in units),
        layer_time_s=tuple(sum(times[start:stop]) for start, stop in units),
        layer_memory_bytes=tuple(sum(memories[start:stop]) for start, stop in units),
        transfers=transfers, num_stages=pp, memory_capacity_bytes=memory_capacity_bytes)


def _pipeline(ctx: SearchContext, pp: int, microbatch_counts: list[int], ilp_time_s: float) -> Plan:
    """The fastest GPipe plan with pp stages; when no split fits memory, the fastest
    split regardless (its prediction then says it does not fit)."""
    capacity = ctx.cluster.device.memory_bytes
    try:
        plans = [_pipeline_with(ctx, pp, m, capacity, ilp_time_s, microbatch_counts)
                 for m in microbatch_counts]
    except InfeasiblePlanError:  # memory does not depend on m: no m fits
        plans = [_pipeline_with(ctx, pp, m, None, ilp_time_s, microbatch_counts)
                 for m in microbatch_counts]
    return min(plans, key=lambda p: (p.predicted.step_time_s, p.strategy.num_microbatches))


def _pipeline_with(ctx: SearchContext, pp: int, m: int, capacity: float | None, ilp_time_s: float,
                   choices: list[int]) -> Plan:
    p, device = ctx.profile, ctx.cluster.device
    split: Split = best_split(_split_problem(ctx, pp, ctx.global_batch // m, ctx.global_batch,
                                           capacity), time_limit_s=ilp_time_s)
    bounds = ctx.unit_bounds(tuple((c.start, c.stop) for c in split.stages))
    split = replace(split, stages=tuple(replace(c, start=lo, stop=hi)
                                        for c, (lo, hi) in zip(split.stages, bounds)))
    slow = split.slowest_stage
    optimizer_s = max(cm.optimizer_time_s(
        sum(l.param_bytes for l in p.layers[c.start:c.stop]),
        sum(l.grad_bytes for l in p.layers[c.start:c.stop]),
        sum(l.optimizer_bytes for l in p.layers[c.start:c.stop]), device)
        for c in split.stages)
    breakdown = Breakdown(compute_s=m * slow.compute_s, communication_s=m * slow.send_s,
                          bubble_s=cm.batch_barrier_bubble_s(pp, slow.time_s, m)
                          if ctx.batch_barrier else (pp - 1) * slow.time_s, recompute_s=0.0,
                          optimizer_s=optimizer_s)
    breakdown = cm.with_shared_cores(
        breakdown, [m * c.compute_s + optimizer_s for c in split.stages], ctx.cluster)
    devices = ctx.cluster.device_names()[:pp]
    stages = tuple(Stage(layers=ctx.names[c.start:c.stop], devices=(devices[s],))
                   for s, c in enumerate(split.stages))
    solver = (f"{split.solver}; num_microbatches {m} chosen from {choices} by predicted step "
              "time" + ("" if capacity is not None else
                        "; no split fits memory, shown with the fastest split regardless"))
    return ctx.plan(f"pipeline pp={pp} m={m}",
                    Strategy(dp=1, tp=1, pp=pp, microbatch_size=ctx.global_batch // m,
                             num_microbatches=m, schedule="gpipe"),
                    stages, breakdown,
                    tuple((devices[s], c.memory_bytes) for s, c in enumerate(split.stages)), solver)


# --- a strategy fixed by the caller ------------------------------------------------------------

def check_microbatch_size(microbatch_size: int, global_batch: int, dp: int = 1) -> None:
    """PlannerError unless ``microbatch_size`` divides a replica's batch, global batch / dp
    (each replica runs a whole number of micro-batches)."""
    local = global_batch // dp
    if microbatch_size < 1 or microbatch_size > local or local % microbatch_size:
        sizes = [d for d in divisors(local) if d <= 4096]
        where = (f"the global batch {global_batch}" if dp == 1 else
                 f"the batch per replica, {local} (global batch {global_batch} / dp {dp})")
        raise PlannerError(
            f"micro-batch size {microbatch_size} does not divide {where}: each replica runs a "
            "whole number of micro-batches. Choose a --microbatch-size that divides it, e.g. "
            f"one of {sizes[:12]}{' ...' if len(sizes) > 12 else ''}, or leave it out to "
            "have it searched.")


def _nothing_to_price(ctx: SearchContext, knobs: Mapping[str, Any]) -> str:
    return (f"the settings {dict(knobs)} leave no strategy to price on {ctx.cluster.name!r} "
            f"({ctx.cluster.num_devices} devices, global batch {ctx.global_batch}): the "
            "micro-batch size must divide some replica's batch (global batch / dp), "
            "--schedule interleaved and --virtual-stages need a pipeline of at least 2 "
            "stages with enough layers and micro-batches. Drop or change one of them.")


def _check_fix(fix: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(fix, Mapping):
        raise PlannerError(f"fix is {fix!r}; expected a mapping such as {{'dp': 4}} or "
                           "{'pp': 2, 'num_microbatches': 4}.")
    unknown = sorted(set(fix) - set(FIX_KEYS))
    if unknown:
        raise PlannerError(f"fix has unknown key(s) {unknown}; expected some of {FIX_KEYS}.")
    for key, value in fix.items():
        if key == "recompute":
            if value not in RECOMPUTE:
                raise PlannerError(f"fix recompute={value!r}; expected one of {RECOMPUTE}.")
        elif key == "schedule":
            if value not in ("gpipe", "1f1b", "interleaved"):
                raise PlannerError(f"fix schedule={value!r}; expected gpipe, 1f1b or "
                                   "interleaved.")
        elif key == "layout":
            if value not in LAYOUTS:
                raise PlannerError(f"fix layout={value!r}; expected one of {LAYOUTS} (device "
                                   "order, innermost first: planner.plan).")
        elif key == "optimizer_sharding":
            if not isinstance(value, bool):
                raise PlannerError(f"fix optimizer_sharding={value!r}; expected true or false.")
        elif key == "zero_stage":
            if value not in ZERO_STAGES or isinstance(value, bool):
                raise PlannerError(f"fix zero_stage={value!r}; expected one of {ZERO_STAGES}.")
        elif key == "sequence_parallel":
            if not isinstance(value, bool):
                raise PlannerError(f"fix sequence_parallel={value!r}; expected true or false.")
        elif key == "offload":
            if value not in OFFLOAD:
                raise PlannerError(f"fix offload={value!r}; expected one of {OFFLOAD}.")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlannerError(f"fix {key}={value!r}; expected a whole number >= 1.")
    out = dict(fix)
    if "optimizer_sharding" in out:  # the ZeRO-1 switch, an alias of zero_stage 0 / 1
        sharded = out.pop("optimizer_sharding")
        if "zero_stage" in out and (out["zero_stage"] >= 1) != sharded:
            raise PlannerError(f"fix has optimizer_sharding={sharded} and zero_stage="
                               f"{out['zero_stage']}, which disagree; give zero_stage only.")
        out.setdefault("zero_stage", int(sharded))
    return out


def _fixed(ctx: SearchContext, fix: Mapping[str, Any], time_limit_s: float) -> SearchResult:
    dp, tp, pp, cp = fix.get("dp", 1), fix.get("tp", 1), fix.get("pp", 1), fix.get("cp", 1)
    m = fix.get("num_microbatches")
    n, b = ctx.cluster.num_devices, ctx.global_batch
    # tp may span nodes (slow, but it runs): its all-reduces are priced over the
    # inter-node link (collectives.tensor_group_allreduce_time_s)
    if dp * cp * tp * pp > n:
        raise InfeasiblePlanError(f"fix asks for dp*cp*tp*pp = {dp * cp * tp * pp} devices; "
                                  f"cluster {ctx.cluster.name!r} has {n}. Use a bigger cluster.")
    if ctx.units and (fix.get("sequence_parallel") or cp > 1):
        raise PlannerError(
            f"fix asks for {'sequence' if fix.get('sequence_parallel') else 'context'} "
            f"parallelism, but model {ctx.profile.model_name!r} has blocks (custom layers with "
            f"sub-layers: {', '.join(ctx.profile.blocks[:3])}...) whose own code between "
            "sub-layers runs on whole sequences; apply splits sequences only between Keras "
            "layers. Leave sequence_parallel and cp out of --fix (tensor parallelism splits "
            "the blocks' projections).")
    seq = sequence_length(ctx.profile)
    if cp > 1 and (not seq or seq % cp):
        raise PlannerError(
            f"fix asks for cp={cp}, but " + (f"the sequence of {seq} tokens does not split into "
                                             f"{cp} equal chunks; use a cp that divides it."
                                             if seq else
                                             f"model {ctx.profile.model_name!r} has no attention "
                                             "layer with a known sequence length; context "
                                             "parallelism splits attention's sequence."))
    if fix.get("sequence_parallel") and tp == 1:
        raise PlannerError("fix asks for sequence parallelism with tp=1; it splits what a "
                           "tensor-parallel group replicates, so it needs tp > 1 (e.g. tp=2).")
    if fix.get("sequence_parallel") and not sequence_splits(ctx.profile, tp):
        raise PlannerError(f"fix asks for sequence parallelism with tp={tp}, but model "
                           f"{ctx.profile.model_name!r} has no per-token layer on a sequence "
                           f"of a known length that divides by {tp} (it is cut into tp equal "
                           "pieces). Use a tp that divides the sequence length, or leave "
                           "sequence_parallel out of --fix.")
    if b % dp:
        raise PlannerError(f"fix asks for dp={dp}, which does not divide the global batch {b}; "
                           "choose a dp that divides it (or change the batch).")
    if pp > len(ctx.pipeline_units):
        raise PlannerError(f"fix asks for pp={pp}, but the model has {len(ctx.pipeline_units)} "
                           "layers a stage boundary may fall between (a block counts as one); "
                           "use at most one stage per layer.")
    if m is not None and b % m:
        raise PlannerError(f"fix asks for num_microbatches={m}, which does not divide the "
                           f"global batch {b}.")
    knobs = {k: v for k, v in fix.items() if k in KNOB_KEYS}
    if knobs.get("ep") == 1:  # every classic plan has ep = 1
        del knobs["ep"]
    classic = tp == 1 and cp == 1 and not knobs and (dp == 1 or pp == 1) and (pp > 1 or m in (None, 1))
    evaluated = 1
    if classic and pp == 1:
        plan = _data_parallel(ctx, dp)
    elif classic:
        choices = [m] if m is not None else _microbatch_choices(b, pp)
        if not choices:
            raise PlannerError(f"fix asks for pp={pp}, but the global batch {b} is smaller than "
                               "the number of stages; use a batch of at least pp samples.")
        plan = _pipeline(ctx, pp, choices, time_limit_s / len(choices))
        evaluated = len(choices)
    else:
        if m is not None:
            knobs["microbatch_size"] = b // dp // m if (b // dp) % m == 0 else 0
        if "microbatch_size" in knobs and (knobs["microbatch_size"] < 1
                                           or (b // dp) % knobs["microbatch_size"]):
            raise PlannerError(f"fix asks for a micro-batch that does not divide the local batch "
                               f"{b // dp} (global batch {b} / dp {dp}); choose a divisor.")
        pricer = Pricer(ctx)
        estimates = [pricer.estimate(c) for c in
                     hybrid_choices(ctx, knobs, skip_classic=False, shape=(dp, tp, pp, cp))]
        if not estimates:
            raise PlannerError(f"fix {dict(fix)} leaves no strategy to price; check that the "
                               "micro-batch size divides the local batch.")
        cap = ctx.cluster.device.memory_bytes
        best = min(estimates, key=lambda e: (not e.fits(cap), e.step_time_s, e.choice.name))
        plan = pricer.to_plan(best)
        evaluated = len(estimates)
    plan = with_batch_norm(plan, ctx.profile, ctx.batch_norm)
    validate_plan(plan, ctx.profile, error_type=SolverError)
    pred = plan.predicted
    reason = (f"{plan.name} was fixed by the request ({dict(fix)}); it is predicted to take "
              f"{fmt_seconds(pred.step_time_s)} per step and needs {fmt_bytes(pred.max_memory_bytes)} "
              f"of {fmt_bytes(pred.memory_capacity_bytes)} per device")
    reason += "." if pred.fits else "; it does NOT fit in memory."
    plan = plan.with_reason(reason + _expert_reason(plan, [plan], ctx.profile))
    return SearchResult(chosen=plan, candidates=(plan,), evaluated=evaluated)


# --- explaining the answer ----------------------------------------------------------------

def _reason(ranked: list[Plan]) -> str:
    """Why ``ranked[0]`` was chosen, in the words of the rule that chose it: the fastest
    plan that fits ("predicted 1.3x faster than the runner-up"), or a simpler plan within
    SIMPLICITY_TOLERANCE of the fastest ("chosen for simplicity"). A ratio below 1 is
    never called faster."""
    chosen = ranked[0]
    pred = chosen.predicted
    fits_text = (f"fits in {fmt_bytes(pred.max_memory_bytes)} of "
                 f"{fmt_bytes(pred.memory_capacity_bytes)} per device")
    fitting = [p for p in ranked if p.predicted.fits]
    fastest = min(fitting, key=_rank_key) if fitting else chosen
    others = [p for p in fitting if p is not chosen]
    if not others:
        text = f"{chosen.name} is the only candidate that {fits_text}"
    elif fastest is not chosen and fastest.predicted.step_time_s < pred.step_time_s:
        slower = 100 * (pred.step_time_s / fastest.predicted.step_time_s - 1)
        text = (f"{chosen.name} is chosen for simplicity: within "
                f"{f'{slower:.1f}' if slower >= 0.1 else f'{slower:.2g}'}% of the "
                f"fastest ({fastest.name}, {fmt_seconds(pred.step_time_s)} vs "
                f"{fmt_seconds(fastest.predicted.step_time_s)} per step), and a plan without "
                "tensor parallelism, a dp x pp hybrid, recomputation, ZeRO, offloading or "
                "expert parallelism "
                f"within {100 * SIMPLICITY_TOLERANCE:.0f}% of the fastest is preferred (the "
                f"cost model's error is larger); it {fits_text}")
    else:
        runner = min(others, key=_rank_key)
        ratio = runner.predicted.step_time_s / pred.step_time_s
        times = (f"({fmt_seconds(pred.step_time_s)} vs "
                 f"{fmt_seconds(runner.predicted.step_time_s)} per step)")
        if ratio >= 1.005:
            text = (f"{chosen.name} is predicted {ratio:.{1 if ratio >= 1.1 else 2}f}x faster "
                    f"than the runner-up {runner.name} {times} and {fits_text}")
        else:  # a tie: the rank key's later terms (fewer devices, then the name) decided
            text = (f"{chosen.name} is predicted as fast as the runner-up {runner.name} "
                    f"{times} (a tie, broken by fewer devices, then by name) and {fits_text}")
    faster = [p for p in ranked if not p.predicted.fits
              and p.predicted.step_time_s < pred.step_time_s]
    if faster:
        f = faster[0]
        text += (f"; the faster {f.name} ({fmt_seconds(f.predicted.step_time_s)}) would need "
                 f"{fmt_bytes(f.predicted.max_memory_bytes)} per device and does not fit")
    return text + "."


def _expert_reason(chosen: Plan, plans: list[Plan], profile: ModelProfile) -> str:
    """Why ``chosen`` has its expert-parallel degree, for a model with mixture-of-experts
    layers ("" otherwise): the experts' state in all and on the busiest pipeline stage's
    devices with and without the split, what its all-to-alls cost per step, and the best
    plan of ``plans`` on the other side (with expert parallelism if ``chosen`` has none,
    without if it has)."""
    layers = moe_layers(profile)
    if not layers:
        return ""
    s = chosen.strategy
    expert_state = {l.name: l.state_bytes * expert_share(l) for l in layers}
    total = sum(expert_state.values())
    per_device = max(sum(expert_state.get(name, 0.0) for k, stage in enumerate(chosen.stages)
                         if k % s.pp == device for name in stage.layers)
                     for device in range(s.pp))  # chunk k on device k % pp; tp replicates
    others = [p for p in plans if (p.strategy.ep > 1) != (s.ep > 1)]
    other = min(others, key=_rank_key) if others else None
    if s.ep > 1:
        text = (f" Expert parallelism ep={s.ep}: the experts' weights, gradients and optimizer "
                f"state are {fmt_bytes(total)} in all, {fmt_bytes(per_device)} per device of "
                f"the busiest pipeline stage if every replica held every expert"
                + (f", more than the {fmt_bytes(chosen.predicted.memory_capacity_bytes)} a "
                   "device has" if cm.with_margin_bytes(per_device)
                   > chosen.predicted.memory_capacity_bytes else "")
                + f"; split over {s.ep} ranks of each data-parallel group they take "
                f"{fmt_bytes(per_device / s.ep)} (before ZeRO), and the {ALL_TO_ALLS_PER_LAYER} "
                f"token all-to-alls per MoE layer and micro-batch cost "
                f"{fmt_seconds(chosen.predicted.all_to_all_s)} per step")
        label = "without expert parallelism"
    else:
        text = (f" No expert parallelism (ep=1): every data-parallel replica holds all the "
                f"experts, {fmt_bytes(per_device)} of their state per device of the busiest "
                "pipeline stage, and no token all-to-all is needed")
        label = "with expert parallelism"
    if other is not None:
        o = other.predicted
        if not o.fits:
            text += (f"; the fastest plan {label}, {other.name}, would need "
                     f"{fmt_bytes(o.max_memory_bytes)} per device and does not fit in "
                     f"{fmt_bytes(o.memory_capacity_bytes)}")
        else:
            text += (f"; the fastest plan {label}, {other.name}, takes "
                     f"{fmt_seconds(o.step_time_s)} per step vs "
                     f"{fmt_seconds(chosen.predicted.step_time_s)}"
                     + (f" (all-to-alls {fmt_seconds(o.all_to_all_s)})" if o.all_to_all_s
                        else ""))
    return text + "."


def _nothing_fits(ctx: SearchContext, ranked: list[Plan], estimates: list[Estimate] = ()) -> str:
    p, cluster, b = ctx.profile, ctx.cluster, ctx.global_batch
    cap = cluster.device.memory_bytes
    least = min(ranked, key=lambda x: (x.predicted.max_memory_bytes, x.name))
    activations = cm.scaled(p.activation_bytes + sum(ctx.input_bytes), b, p.batch_size)
    text = (f"No strategy fits in {fmt_bytes(cap)} per device on {cluster.name} "
            f"({cluster.num_devices} devices, global batch {b}). Memory binds: the model's state "
            f"(weights + gradients + optimizer state) is {fmt_bytes(p.state_bytes)} and the "
            f"activations of the global batch are {fmt_bytes(activations)}; the candidate that "
            f"needs least, {least.name}, needs {fmt_bytes(least.predicted.max_memory_bytes)} "
            "per device.")
    need = least.predicted.max_memory_bytes
    max_pp = min(cluster.num_devices, len(ctx.pipeline_units))
    if max_pp > 1:  # the most even split of memory over the most stages
        need = min(need, math.ceil(min_max_stage_memory(_split_problem(ctx, max_pp, b, b, cap))[0]))
    if estimates:
        lean = min(estimates, key=lambda e: (max(e.stage_memory_bytes), e.choice.name))
        if max(lean.stage_memory_bytes) < need:
            need = max(lean.stage_memory_bytes)
            text += (f" With every saver on, the leanest strategy, {lean.choice.name}, still "
                     f"needs {fmt_bytes(need)} per device.")
    fixes = [f"devices with at least {fmt_bytes(need)} each"]
    more = _devices_that_would_fit(ctx)
    if more:
        fixes.append(more)
    worst = max(p.layers, key=lambda l: l.state_bytes)
    if cm.with_margin_bytes(worst.state_bytes) > cap and worst.is_moe:
        experts_bytes = worst.state_bytes * expert_share(worst)
        text += (f" Layer {worst.name!r} alone holds {fmt_bytes(worst.state_bytes)} of weights, "
                 "gradients and optimizer state (before the allocator margin), "
                 f"{fmt_bytes(experts_bytes)} of it in its {worst.moe_experts} experts: expert "
                 "parallelism divides that part by ep (up to ep = "
                 f"{worst.moe_experts}, with at least as many data-parallel replicas), "
                 "tensor parallelism none of it (planner.experts).")
    elif cm.with_margin_bytes(worst.state_bytes) > cap:
        text += (f" Layer {worst.name!r} alone holds {fmt_bytes(worst.state_bytes)} of weights, "
                 "gradients and optimizer state (before the allocator margin), so more devices "
                 "help only through tensor parallelism, which divides it by tp "
                 f"<= {ctx.cluster.devices_per_node} (devices per node).")
    largest = _largest_batch_that_fits(ctx, b - 1)
    if largest:
        fixes.append(f"a global batch of at most {largest} (activation memory grows with it)")
    return text + " Smallest changes that would fit: " + "; or ".join(fixes) + "."


def _devices_that_would_fit(ctx: SearchContext) -> str | None:
    """The fewest devices (more than the cluster has) with which a pipeline or data
    parallelism would fit this batch, as a phrase; None if neither would."""
    cap, n, b = ctx.cluster.device.memory_bytes, ctx.cluster.num_devices, ctx.global_batch
    options = []
    stages = min_stages_to_fit(_split_problem(ctx, 1, b, b, cap))
    if stages is not None and stages > n:
        options.append((stages, f"at least {stages} devices (a pipeline of {stages} stages)"))
    for dp in (d for d in divisors(b) if d > n):
        if math.ceil(sum(ctx.layer_memories_bytes(b // dp))) <= cap:
            options.append((dp, f"at least {dp} devices (data parallel dp={dp})"))
            break
    return min(options)[1] if options else None


def _largest_batch_that_fits(ctx: SearchContext, upper: int) -> int | None:
    """Largest batch <= upper that some candidate shape could hold (binary search;
    memory grows with the batch)."""
    cap, n = ctx.cluster.device.memory_bytes, ctx.cluster.num_devices
    max_pp = min(n, len(ctx.pipeline_units))

    def fits(batch: int) -> bool:
        # data parallel, dp = n: at least one whole sample per device
        if math.ceil(sum(ctx.layer_memories_bytes(math.ceil(batch / n)))) <= cap:
            return True
        stages = min_stages_to_fit(_split_problem(ctx, 1, batch, batch, cap))
        return stages is not None and stages <= max_pp

    lo, hi = 0, upper  # fits(lo) is taken as true, answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo or None

