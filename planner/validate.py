"""Re-checking a Plan against the model profile and its own cluster.

Pipeline position: every plan ``planner.search`` returns passes through
``validate_plan`` (a broken one is a solver bug: SolverError); a plan read back
from plan.json can be checked the same way before it is applied (a broken one
does not match: PlanMismatchError).
"""
from __future__ import annotations

from typing import Sequence

from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.experts import check_expert_degree
from tfplan.planner.plan import LAYOUTS, PLACEMENTS, Plan
from tfplan.profiler.model_profile import ModelProfile


Signature = Sequence[tuple[str, str, int]]


def validate_plan(plan: Plan, model: ModelProfile | Signature, *,
                  error_type: type[PlannerError] = PlanMismatchError) -> None:
    """Raise ``error_type`` naming the first way ``plan`` is not a valid plan for ``model``.

    ``model`` is the ModelProfile the plan was searched for, or the signature of a
    live model (``profiler.signature.model_signature``: (layer, type, params) in
    the model's order), as ``apply.wrap`` passes it.

    Checks: the model signature; strategy numbers (dp*tp*pp <= devices, ep dividing dp
    and, against a ModelProfile, every mixture-of-experts layer's expert count,
    microbatch_size * num_microbatches * dp == global_batch, schedule, layout); every
    profiled layer in exactly one stage, stages contiguous in the profile order
    (for ``placement == "general"`` instead: dp = tp = 1 and one micro-batch,
    layers anywhere); pp stages of dp devices each; devices exist in the plan's
    cluster and are used once; ``tp_splits`` names model layers with known splits (and
    only when tp > 1); the prediction names the plan's devices and its breakdown sums
    to its step time. ``search`` passes ``error_type=SolverError``.
    """
    def fail(what: str) -> None:
        raise error_type(f"Plan {plan.name!r} for model {plan.model_name!r}: {what}")

    signature = tuple(model.signature() if isinstance(model, ModelProfile) else model)
    if error_type is PlanMismatchError:  # a live model: matched by structure, not names
        plan = plan.for_model(signature)
    elif plan.model_signature != signature:
        fail("its model signature differs from the profile's.")
    _check_strategy(plan, fail)
    _check_stages(plan, [name for name, _, _ in signature], fail)
    if isinstance(model, ModelProfile):
        _check_blocks(plan, model, fail)
        _check_experts(plan, model, fail)
    _check_tp_splits(plan, [name for name, _, _ in signature], fail)
    _check_devices(plan, fail)
    _check_prediction(plan, fail)


def _check_blocks(plan: Plan, profile: ModelProfile, fail) -> None:
    """Every entry of a block (``LayerProfile.block``) in the block's stage: a block is
    placed whole (``apply`` re-creates it on one stage's devices)."""
    stage_of = {name: s for s, stage in enumerate(plan.stages) for name in stage.layers}
    where: dict[str, int] = {}
    for layer in profile.layers:
        if layer.block and layer.name in stage_of:
            s = where.setdefault(layer.block, stage_of[layer.name])
            if s != stage_of[layer.name]:
                fail(f"block {layer.block!r} is cut between stages {s} and "
                     f"{stage_of[layer.name]} (at {layer.name!r}); a block's entries must all be "
                     "in one stage. Re-plan: stages cut between blocks only.")


def _check_experts(plan: Plan, profile: ModelProfile, fail) -> None:
    """ep > 1 only for a model with mixture-of-experts layers, dividing each one's E
    (``planner.experts.check_expert_degree``; ep | dp is ``_check_strategy``'s)."""
    s = plan.strategy
    try:
        check_expert_degree(profile, s.ep, s.dp)
    except PlannerError as e:
        fail(f"its expert-parallel degree is wrong: {e}")


def _check_strategy(plan: Plan, fail) -> None:
    s, cluster = plan.strategy, plan.cluster
    if s.ep < 1 or s.dp % s.ep:
        fail(f"ep = {s.ep} with dp = {s.dp}; expected ep >= 1 dividing dp (expert parallelism "
             "splits the experts over ranks of the data-parallel group).")
    if s.num_devices > cluster.num_devices:
        fail(f"dp*cp*tp*pp = {s.dp}*{s.cp}*{s.tp}*{s.pp} = {s.num_devices} devices, but cluster "
             f"{cluster.name!r} has {cluster.num_devices}. Re-plan for this cluster.")
    if s.sequence_parallel and s.tp == 1:
        fail("sequence_parallel is true with tp = 1; it needs tp > 1.")
    if s.microbatch_size * s.num_microbatches * s.dp != plan.global_batch:
        fail(f"microbatch_size * num_microbatches * dp = {s.microbatch_size} * "
             f"{s.num_microbatches} * {s.dp} = {s.microbatch_size * s.num_microbatches * s.dp}, "
             f"expected the global batch {plan.global_batch}.")
    if s.pp == 1 and s.schedule != "none":
        fail(f"schedule is {s.schedule!r} with pp = 1; expected 'none'.")
    if s.pp > 1 and s.schedule == "none":
        fail(f"pp = {s.pp} but schedule is 'none'; expected a pipeline schedule (gpipe, 1f1b "
             "or interleaved).")
    if (s.schedule == "interleaved") != (s.virtual_stages > 1):
        fail(f"schedule is {s.schedule!r} with virtual_stages = {s.virtual_stages}; the "
             "interleaved schedule and only it has more than one model chunk per device.")
    if s.layout not in LAYOUTS:
        fail(f"layout is {s.layout!r}; expected one of {LAYOUTS} (planner.plan).")
    if plan.placement not in PLACEMENTS:
        fail(f"placement is {plan.placement!r}; expected one of {PLACEMENTS}.")
    if plan.placement == "general" and (s.dp, s.tp, s.num_microbatches) != (1, 1, 1):
        fail(f"it is a general placement with dp = {s.dp}, tp = {s.tp}, num_microbatches = "
             f"{s.num_microbatches}; a general placement runs one batch on one device per "
             "stage, expected dp = tp = num_microbatches = 1.")


def _check_stages(plan: Plan, order: list[str], fail) -> None:
    s = plan.strategy
    if len(plan.stages) != s.pp * s.virtual_stages:
        fail(f"it has {len(plan.stages)} stages; expected pp = {s.pp}"
             + (f" x virtual_stages = {s.virtual_stages}" if s.virtual_stages > 1 else "") + ".")
    position = {name: i for i, name in enumerate(order)}
    seen: dict[str, int] = {}
    for k, stage in enumerate(plan.stages):
        if not stage.layers:
            fail(f"stage {k} holds no layers; every stage needs at least one.")
        for name in stage.layers:
            if name not in position:
                fail(f"stage {k} holds layer {name!r}, which the model does not have.")
            if name in seen:
                fail(f"layer {name!r} is in stage {seen[name]} and again in stage {k}; "
                     "each layer belongs to exactly one stage.")
            seen[name] = k
        if len(stage.devices) != s.replicas * s.tp:
            fail(f"stage {k} has {len(stage.devices)} devices; expected one per data-parallel "
                 f"replica, context-parallel rank and tensor rank (dp = {s.dp} x cp = {s.cp} "
                 f"x tp = {s.tp}).")
    missing = [name for name in order if name not in seen]
    if missing:
        fail(f"layer(s) {', '.join(repr(n) for n in missing[:5])} are in no stage; every "
             "profiled layer must be placed.")
    if plan.placement == "general":  # any layers on any device: no contiguity
        return
    placed = [name for stage in plan.stages for name in stage.layers]
    for i, name in enumerate(placed):
        if position[name] != i:
            k = seen[name]
            expected = order[i]
            fail(f"stage {k} is not contiguous in the model's layer order: layer {name!r} comes "
                 f"where layer {expected!r} (position {i}) belongs. Stages must hold runs of "
                 "consecutive layers, in order.")


TP_SPLITS = ("column", "row", "heads", "vocab")  # Plan.tp_splits values (profiler.comm)


def _check_tp_splits(plan: Plan, order: list[str], fail) -> None:
    known, seen = set(order), set()
    for name, split in plan.tp_splits:
        if split not in TP_SPLITS:
            fail(f"tp_splits gives layer {name!r} the split {split!r}; expected one of "
                 f"{TP_SPLITS} (a replicated layer is left out of tp_splits).")
        if name not in known:
            fail(f"tp_splits names layer {name!r}, which the model does not have.")
        if name in seen:
            fail(f"tp_splits names layer {name!r} twice; each split layer is named once.")
        seen.add(name)
    if plan.tp_splits and plan.strategy.tp == 1:
        fail(f"tp_splits names {len(plan.tp_splits)} split layer(s) but tp = 1; a plan without "
             "tensor parallelism splits no layer.")


def _check_devices(plan: Plan, fail) -> None:
    known = set(plan.cluster.device_names())
    used: dict[str, int] = {}
    pp = plan.strategy.pp
    for k, stage in enumerate(plan.stages):
        if k >= pp and plan.strategy.virtual_stages > 1:  # interleaved: chunk k on k % pp's
            if stage.devices != plan.stages[k % pp].devices:
                fail(f"stage {k} runs on {list(stage.devices)}, expected the devices of stage "
                     f"{k % pp} ({list(plan.stages[k % pp].devices)}): an interleaved pipeline "
                     "puts model chunk k on pipeline device k mod pp.")
            continue
        for device in stage.devices:
            if device not in known:
                fail(f"stage {k} uses device {device!r}, which cluster {plan.cluster.name!r} "
                     f"does not have (it has {', '.join(plan.cluster.device_names()[:4])}...).")
            if device in used:
                fail(f"device {device!r} is used by stage {used[device]} and again by stage "
                     f"{k}; each device holds one stage of one replica.")
            used[device] = k


def _check_prediction(plan: Plan, fail) -> None:
    p = plan.predicted
    named = [d for d, _ in p.peak_memory_bytes_per_device]
    if named != list(plan.devices):
        fail(f"the predicted memory names devices {named}, expected the plan's devices "
             f"{list(plan.devices)} in order.")
    total = p.breakdown.total_s
    if abs(total - p.step_time_s) > 1e-9 * max(abs(p.step_time_s), 1e-30) + 1e-15:
        fail(f"its step-time breakdown sums to {total!r} s but step_time_s is "
             f"{p.step_time_s!r} s.")
    if p.memory_capacity_bytes != plan.cluster.device.memory_bytes:
        fail(f"it predicts against {p.memory_capacity_bytes} bytes per device, but the "
             f"cluster's devices have {plan.cluster.device.memory_bytes}.")
