"""Batch statistics in a plan: how BatchNormalization's statistics are computed, and
what that costs.

Pipeline position: ``planner.search`` prices every candidate, then ``with_batch_norm``
sets ``Strategy.batch_norm`` and adds this cost; ``plan analyze`` prints ``describe``.
``apply.batch_stats`` runs the rule. A model without BatchNormalization layers pays
nothing and gets no note.

* ``global`` (the default: equal to one device). Each BatchNormalization layer uses the
  mean and variance of the whole step's batch: every data-parallel replica and every
  micro-batch. Costs:

  - dp > 1: per layer and step, all-reduces over its stage's data-parallel group
    (``ALLREDUCES_PER_LAYER``: the forward's element count, sum and squared deviations
    -- two passes, as ``tf.nn.moments`` -- and the backward's gradients of the two
    sums), each of C float32 values (C the layer's channels, its output's last axis).
    They are small, so their latency is what counts; they are on the critical path
    (nothing overlaps a layer waiting for its statistics), so they add to the step.
    SyncBatchNorm as PyTorch and TensorFlow's ``synchronized=True`` do it.
  - pp > 1 with m > 1 micro-batches: a layer needs every micro-batch's input before any
    micro-batch continues, forward and backward, so micro-batches cannot overlap across
    stages: each stage runs all m micro-batches before the next stage starts, the step
    is pp x m x t_stage instead of (m + pp - 1) x t_stage, i.e. the bubble is m times
    GPipe's (pp - 1) x t_stage. The micro-batches run in GPipe order (1F1B's order
    would wait on itself), so the search offers GPipe only to such plans and holds
    every micro-batch's activations, as GPipe does.
* ``local``: each replica and micro-batch normalises with its own statistics (GPipe's
  rule, Huang et al., 2019; Keras' under MirroredStrategy): no collective on the critical
  path, but the losses and the learned weights differ from one device's, the more the
  smaller the parts are. The moving statistics get one update per step either way, the
  mean over the parts (``apply.batch_stats``; ``apply.spmd.batch_norm``: one all-reduce of
  each layer's 2 C values after its forward, counted in ``planner.traffic``, its latency
  not in the step time).
"""
from __future__ import annotations

import dataclasses

from tfplan.core.cluster import ClusterSpec
from tfplan.planner import collectives as coll
from tfplan.planner.traffic import ALLREDUCES_PER_LAYER, BATCH_NORM_TYPES, STAT_BYTES, channels
from tfplan.planner.plan import Plan
from tfplan.planner.topology import dp_group_devices
from tfplan.profiler.model_profile import LayerProfile, ModelProfile



def batch_norm_layers(profile: ModelProfile) -> list[LayerProfile]:
    """The profile's BatchNormalization layers, in profile order."""
    return [l for l in profile.layers if l.kind in BATCH_NORM_TYPES]


def has_barrier(plan: Plan, profile: ModelProfile) -> bool:
    """True when global statistics join a pipeline's micro-batches (module docstring)."""
    s = plan.strategy
    return s.batch_norm == "global" and s.pp > 1 and s.num_microbatches > 1 \
        and bool(batch_norm_layers(profile))


def sync_time_s(plan: Plan, profile: ModelProfile, cluster: ClusterSpec) -> float:
    """Seconds per step the global statistics' all-reduces add (0 for dp = 1 or local)."""
    s = plan.strategy
    if s.batch_norm != "global" or s.dp == 1:
        return 0.0
    stage_of = {name: k % s.pp for k, stage in enumerate(plan.stages) for name in stage.layers}
    total = 0.0
    for layer in batch_norm_layers(profile):
        group = dp_group_devices(s.layout, s.dp, s.tp, s.pp, stage_of.get(layer.name, 0))
        total += ALLREDUCES_PER_LAYER * coll.group_allreduce_time_s(
            channels(layer) * STAT_BYTES, group, cluster)
    return total


def with_batch_norm(plan: Plan, profile: ModelProfile, mode: str) -> Plan:
    """``plan`` with ``Strategy.batch_norm = mode`` and the all-reduces' cost (module
    docstring) in ``communication_s``. The pipeline barrier is priced where the bubble
    is (``cost_model.batch_barrier_bubble_s``, ``SearchContext.batch_barrier``)."""
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy,
                                                                  batch_norm=mode))
    if not batch_norm_layers(profile) or mode != "global":
        return plan
    sync_s = sync_time_s(plan, profile, plan.cluster)
    if sync_s == 0.0:
        return plan
    b = plan.predicted.breakdown
    breakdown = dataclasses.replace(b, communication_s=b.communication_s + sync_s)
    p = plan.predicted
    step_s = breakdown.total_s
    factor = p.step_time_s / step_s
    predicted = dataclasses.replace(
        p, step_time_s=step_s, breakdown=breakdown, samples_per_s=plan.global_batch / step_s,
        model_tflops_per_device=p.model_tflops_per_device * factor,
        hardware_tflops_per_device=p.hardware_tflops_per_device * factor)
    return dataclasses.replace(plan, predicted=predicted)


def describe(plan: Plan, profile: ModelProfile) -> dict | None:
    """What ``plan analyze`` says about batch statistics (text and ``--json``); None for
    a model without BatchNormalization layers."""
    layers = batch_norm_layers(profile)
    if not layers:
        return None
    s = plan.strategy
    parts = s.dp * s.num_microbatches
    sync_s = sync_time_s(plan, profile, plan.cluster)
    barrier = has_barrier(plan, profile)
    per_part = plan.global_batch // max(1, parts)
    if s.batch_norm == "local":
        text = (f"batch statistics: local, per part ({s.dp} replica(s) x {s.num_microbatches} "
                f"micro-batch(es) of {per_part} samples) for {len(layers)} BatchNormalization "
                "layer(s): free, but" + (" the losses differ from one device's"
                                         if parts > 1 else " with one part equal to one device")
                + " (--batch-norm global synchronises them)")
    else:
        costs = []
        if sync_s:
            costs.append(f"{ALLREDUCES_PER_LAYER * len(layers)} small all-reduces per step "
                         f"(+{sync_s * 1e3:.3g} ms)")
        if barrier:
            costs.append(f"a barrier per layer across the {s.num_microbatches} micro-batches "
                         "(GPipe order; the pipeline bubble is "
                         f"{s.num_microbatches}x GPipe's, "
                         f"{plan.predicted.breakdown.bubble_s * 1e3:.3g} ms)")
        text = (f"batch statistics: global over all {parts} part(s) for {len(layers)} "
                "BatchNormalization layer(s), equal to one device; costs "
                + ("; ".join(costs) if costs else "nothing here (one part)")
                + ((" (--batch-norm local is free and differs from one device)")
                   if costs else ""))
    return {"mode": s.batch_norm, "layers": len(layers), "parts": parts,
            "samples_per_part": per_part, "sync_s": sync_s, "pipeline_barrier": barrier,
            "bubble_s": plan.predicted.breakdown.bubble_s,
            "equal_to_one_device": s.batch_norm == "global" or parts == 1,
            "text": text}

